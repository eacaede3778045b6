"""tests/gpu/torch_check.py - real PyTorch processes through refit: a trainer registers real
torch tensors (views into caching-allocator blocks, so region offsets matter; one of them a
fused [q; k] buffer described as two pieces), an engine receives into real torch tensors of a
different sharding (tp=2: two clients in one process, one transposed store), and after each
commit compares them with torch.equal against the expected values.

    python3 torch_check.py trainer SOCKET VERSIONS
    python3 torch_check.py engine SOCKET VERSIONS

The trainer runs on $REFIT_TRAINER_GPU (default cuda:0), the engine on $REFIT_ENGINE_GPU
(default cuda:1): the same GPU for a colocated run.
"""
import os
import sys

import torch

import refit

H, Q, K = 512, 1024, 256          # hidden, q rows, k rows


def weights(version, device):
    g = torch.Generator(device="cpu").manual_seed(1000 + version)
    q = torch.randn(Q, H, generator=g).to(torch.bfloat16)
    k = torch.randn(K, H, generator=g).to(torch.bfloat16)
    o = torch.randn(H, Q, generator=g)                     # fp32
    return q.to(device), k.to(device), o.to(device)


def trainer(sock, versions):
    dev = torch.device(os.environ.get("REFIT_TRAINER_GPU", "cuda:0"))
    torch.cuda.set_device(dev)
    pad = torch.empty(12345, dtype=torch.uint8, device=dev)  # so blocks do not start at offset 0
    qk = torch.empty(Q + K, H, dtype=torch.bfloat16, device=dev)   # fused [q; k]
    o = torch.empty(H, Q, dtype=torch.float32, device=dev)
    c = refit.Client(refit.TRAINER, "torch-trainer", 0, sock)
    r_qk = c.register_cuda(qk.data_ptr(), qk.numel() * qk.element_size())
    r_o = c.register_cuda(o.data_ptr(), o.numel() * o.element_size())
    c.add_piece("layer.q_proj.weight", "bf16", [Q, H], r_qk, 0, [0, 0], [Q, H])
    c.add_piece("layer.k_proj.weight", "bf16", [K, H], r_qk, Q * H * 2, [0, 0], [K, H])
    c.add_piece("layer.o_proj.weight", "fp32", [H, Q], r_o, 0, [0, 0], [H, Q])
    c.seal()
    for v in range(1, versions + 1):
        q, k, ow = weights(v, dev)
        qk[:Q].copy_(q)
        qk[Q:].copy_(k)
        o.copy_(ow)
        torch.cuda.synchronize()
        c.publish(v)
        c.wait_released(v, 120000)
        print(f"trainer: version {v} released", flush=True)
    del pad


def engine(sock, versions):
    dev = torch.device(os.environ.get("REFIT_ENGINE_GPU", "cuda:1"))
    torch.cuda.set_device(dev)
    clients, bufs = [], []
    for rank in range(2):
        # tp=2: each rank holds half of q's rows and of k's rows fused as [q_r; k_r], and half
        # of o's columns stored transposed (o_r^T is [Q/2, H]).
        qk = torch.full((Q // 2 + K // 2, H), float("nan"), dtype=torch.bfloat16, device=dev)
        ot = torch.full((Q // 2, H), float("nan"), dtype=torch.float32, device=dev)
        c = refit.Client(refit.ENGINE, f"torch-engine-{rank}", rank, sock)
        r_qk = c.register_cuda(qk.data_ptr(), qk.numel() * qk.element_size())
        r_o = c.register_cuda(ot.data_ptr(), ot.numel() * ot.element_size())
        c.add_piece("layer.q_proj.weight", "bf16", [Q, H], r_qk, 0,
                    [rank * Q // 2, 0], [Q // 2, H])
        c.add_piece("layer.k_proj.weight", "bf16", [K, H], r_qk, (Q // 2) * H * 2,
                    [rank * K // 2, 0], [K // 2, H])
        # o[:, cols] lives transposed: element (i, j) at ot[j - col0, i] -> strides (1, H).
        c.add_piece("layer.o_proj.weight", "fp32", [H, Q], r_o, 0,
                    [0, rank * Q // 2], [H, Q // 2], [1, H])
        c.gate()
        c.seal()
        clients.append(c)
        bufs.append((qk, ot))
    bad = 0
    for v in range(1, versions + 1):
        # Verify what the daemon says it reached: a later commit may come first.
        reached = max(c.wait_version(v, 120000) for c in clients)
        q, k, ow = weights(reached, dev)
        for rank, (qk, ot) in enumerate(bufs):
            ok = (torch.equal(qk[:Q // 2], q[rank * Q // 2:(rank + 1) * Q // 2]) and
                  torch.equal(qk[Q // 2:], k[rank * K // 2:(rank + 1) * K // 2]) and
                  torch.equal(ot, ow[:, rank * Q // 2:(rank + 1) * Q // 2].t()))
            bad += not ok
            print(f"engine rank {rank}: version {reached} torch.equal {ok}", flush=True)
        for c in clients:
            c.consumed(reached)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    role, sock, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    (trainer if role == "trainer" else engine)(sock, n)
