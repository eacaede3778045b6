/* sim/sim.h - what the simulated trainer and engine share: a model's ranks registered through
 * librefit with memory of their own, and the weight pattern that encodes (version, tensor,
 * global index) so that every installed byte can be checked. */
#ifndef RF_SIM_H
#define RF_SIM_H

#include <stdint.h>

#include "layout.h"
#include "model.h"
#include "quant_fmt.h"
#include "refit.h"

typedef struct sim_region {
    uint64_t offset; /* in the rank's memfd */
    uint8_t *base;
    uint64_t size;
    uint32_t id;     /* the daemon's region id */
} sim_region;

typedef struct sim_rank {
    int rank;
    refit_client *c;
    int fd;          /* one memfd holds all the rank's regions, as one allocation would; kept
                        so the regions can be registered again after a reconnect */
    uint8_t *mem;
    uint64_t mem_size;
    uint32_t nregions;
    sim_region *regions;
    uint32_t npieces, cap_pieces;
    rf_piece *pieces; /* region = local region index, tensor = model tensor index; quant:
                         0, or an FP8 piece whose scales are quants[quant - 1] (its
                         scale_region a local region index) */
    uint32_t nquants;
    rf_quant_decl *quants;
    int gpu;         /* -1: host memory (the memfd above); else the GPU holding mem */
    void *gpu_state; /* the VMM allocation's handle, when it is one */
} sim_rank;

typedef struct sim {
    const char *socket;
    rf_side side;
    rf_model *model;
    rf_par par;
    uint64_t *tensor_salt; /* per model tensor, from its name (and SIM_FINITE) */
    int first, count;      /* the ranks this process plays */
    sim_rank *ranks;
    uint64_t bytes;        /* bytes of all pieces of this process */
    int gpu;               /* SIM_HOST, SIM_GPU_PER_RANK or a GPU ordinal */
    int vmm;               /* GPU memory from cuMemCreate (POSIX fd) instead of cudaMalloc */
    uint64_t vmm_chunk;    /* vmm: allocations of this size mapped back to back (0: one) */
    int inproc;            /* engines: registered in-process (host memory never handed to
                              the daemon; on GPUs VMM without a handle type): librefit's
                              installer writes it */
    /* Engines serving FP8 (issue 15): pieces of >= 2 dims whose box lies on the format's grid
     * are registered as float8_e4m3fn with their scales; the others keep the tensor's dtype. */
    int fp8;
    rf_quant_fmt fp8_fmt;
    char fp8_name[40];     /* the format as given, registered so */
    int fp8_off_grid;      /* also pieces whose box is off the grid (the daemon must refuse) */
    uint32_t fp8_scale_pad; /* scale rows padded to a multiple of this many scales (1: dense) */
    uint64_t fp8_pieces, fp8_bytes, fp8_scale_bytes, kept_pieces, kept_bytes;
    /* What the last sim_verify saw of the expected FP8 content: pairs of neighbouring blocks
     * (in a matrix, row-major over its blocks) and how many of them differ in scale; elements
     * and how many are not +-0. A pattern where these are low could not catch misplaced
     * scales or elements. */
    uint64_t fp8_pairs, fp8_pairs_differ, fp8_elems, fp8_elems_nonzero;
} sim;

#define SIM_HOST (-2)
#define SIM_GPU_PER_RANK (-1)

/* Parses --device (host, cuda: rank r on GPU r mod count, cuda:N) into s->gpu; -1 on bad
 * input (printed). */
int sim_parse_device(const char *device, int *gpu);

/* Parses the common options; prints usage and returns -1 on bad input. */
int sim_setup(sim *s, rf_side side, const char *model, int shrink, const char *layout,
              const char *ranks, const char *socket);
/* The same with memory on GPUs: gpu as sim_parse_device gives it, vmm for VMM allocations,
 * vmm_chunk > 0 for VMM allocations of that size mapped back to back. */
int sim_setup_device(sim *s, rf_side side, const char *model, int shrink, const char *layout,
                     const char *ranks, const char *socket, int gpu, int vmm,
                     uint64_t vmm_chunk);
/* The options both simulated clients take: put SIM_COMMON_OPTIONS in the getopt_long table,
 * hand each parsed option to sim_opt, then sim_open. */
typedef struct sim_opts {
    const char *socket, *model, *layout, *ranks, *device, *vmm_chunk_arg;
    const char *fp8;       /* the FP8 format (NULL: none); not a common option */
    int fp8_off_grid;
    uint32_t fp8_scale_pad;
    int shrink, timeout_ms, vmm, inproc, finite;
    uint64_t start, versions, vmm_chunk;
    char gpu_dev[32];
} sim_opts;

#define SIM_COMMON_OPTIONS                                                                     \
    {"socket", 1, 0, 's'}, {"model", 1, 0, 'm'}, {"shrink", 1, 0, 'k'}, {"layout", 1, 0, 'l'}, \
    {"ranks", 1, 0, 'r'}, {"start", 1, 0, 'v'}, {"versions", 1, 0, 'n'},                       \
    {"timeout-ms", 1, 0, 't'}, {"device", 1, 0, 'D'}, {"gpu", 1, 0, 'G'},                      \
    {"cuda-vmm", 0, 0, 'V'}, {"cuda-vmm-chunk", 1, 0, 'C'}, {"inproc", 0, 0, 'I'},         \
    {"finite-weights", 0, 0, 'W' + 256}

/* Defaults: socket from $REFIT_SOCKET else default_socket, start 1, one version, 120 s. */
void sim_opts_init(sim_opts *o, const char *default_socket);
/* Takes one option of SIM_COMMON_OPTIONS: 1 if c was one of them, 0 otherwise. */
int sim_opt(sim_opts *o, int c, const char *arg);
/* Checks the options (a model, a start >= 1, a known device; FP8 only on host memory the
 * daemon maps) and sets the simulation up; -1 when they are bad or the model does not shard
 * so (the reason printed). */
int sim_open(sim *s, rf_side side, sim_opts *o);

/* Connects every rank, registers its memory and pieces, seals. Retries the connection until
 * timeout_ms passes (the daemon may still be starting). */
int sim_register(sim *s, int timeout_ms);
void sim_close(sim *s);

/* Writes the pattern of version into every piece (trainers), or a filler that no version
 * produces (engines, before the first refit). */
void sim_fill(sim *s, uint64_t version);
void sim_fill_garbage(sim *s);
/* Checks every byte of every piece against version; returns the number of wrong elements and
 * prints the first few. An FP8 piece holds the trainers' values of its box at that version
 * quantized by rf_quant_ref (common/data/quant_ref.h), each FP8 byte and each scale compared
 * (one wrong element each), and the padding of its scale rows must be untouched. */
uint64_t sim_verify(sim *s, uint64_t version, int max_report);
/* For the test that proves the check: flips bit 0 of the first FP8 element ("element") or of
 * the first scale ("scale") of the first FP8 piece, or of the first padding byte after a row of
 * scales ("padding", the first piece whose scale rows are padded); prints what it flipped. -1
 * if there is no such piece or what is not one of those. */
int sim_fp8_corrupt(sim *s, const char *what);

double sim_now(void);

#endif
