# tests/e2e/torch-lib.sh - for the refit.torch tests (7x-torch-*.sh): a python3 that has torch
# (CI installs Debian's python3-torch through scripts/deps.sh), and start_torch to run
# tests/e2e/torch_refit.py as a background client like lib.sh's start_trainer.
TORCH_REFIT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/torch_refit.py"
TORCH_PY=""
# system-python3: make asan's wrapper of /usr/bin/python3 (Debian's torch is installed for it).
for py in ${PYTHON:-python3} system-python3 /usr/bin/python3; do
    if "$py" -c "import torch" 2>/dev/null; then TORCH_PY=$py; break; fi
done
if [ -z "$TORCH_PY" ]; then
    echo "skip: no python3 with torch (install python3-torch: scripts/deps.sh)"
    exit 0
fi
export REFIT_LIB="$BIN/librefit.so"

start_torch() {
    local name=$1; shift
    "$TORCH_PY" "$TORCH_REFIT" "$@" > "$E2E_DIR/$name.log" 2>&1 &
    E2E_PIDS="$E2E_PIDS $!"
    eval "${name}_PID=$!"
}
