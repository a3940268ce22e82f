"""Grouped MoE W4A16 (NVFP4 experts) for decode-sized blocks on Hopper, written in Gluon: one warp per program,
each lane loading exactly the code bytes of its mma.sync A fragments and decoding them in registers.

Why: at batch 256 (E=128, top-8: ~16 rows per expert) the Triton kernel (`moe_grouped_gemm._moe_gemm_kernel`)
spends 192 us per layer on 85 us of weight bytes (docs/PERF.md). It is issue-bound the way the Triton KV decode
kernel was: the dequantized tile goes to the MMA through layout conversions (shared-memory round trips and
register shuffles). kv_decode_gluon showed the cure; this is the same design for the expert GEMM:

* Swapped MMA (mma.sync m16n8k16): M = weight rows of one expert, N = the block's sorted token rows (block_m
  8/16/32: one to four n8 tiles), K = the reduction (H for gate/up, F for down), in trips of 128.
* In a trip, lane (g, t) takes the whole 32-element packing group t of weight rows g and g + 8 (16 contiguous
  code bytes each, one 16-byte vector) and its scale pair (one 16-bit shared-memory load). The MMA sums K in any order that
  B follows, so the logical K order inside a trip is kv_decode_gluon's q_order:
      k = 64 h + 32 j3 + 16 j2 + 8 j1 + 2 gr + j0   <->   phys = 32 gr + 16 h + 8 j3 + 4 j2 + 2 j1 + j0
  and the B fragment of lane (g, t) is then the 32 *contiguous* activations of group t of token row g: four
  16-byte vectors, no data movement at all (`x_layout`). `convert_layout(..., assert_trivial=True)` checks both
  claims at compile time.
* One warp per program by default (no shared B; the barriers Gluon puts before each refill of a ring slot cost
  one warp nothing): programs are (block of block_m sorted rows, ROWS weight rows; gate/up: ROWS gate rows and
  the ROWS matching up rows sharing one B). WARPS = 2 or 4 split the rows into 16-row slabs per warp and share
  one x tile (each warp copies a part; a barrier per trip after the copies land): half or a quarter of the L2
  reads of x per weight byte, for 3 barriers per trip among the warps. Bytes per trip and program: codes
  ROWS x 64 (x 2 gated), x block_m x 256 (fp16/bf16). `default_rows`: gated 32, down 64 (64 code rows: 4 KB of
  codes against 4 KB of x at block_m 16), the most without spills: more rows cut the L2 reads of x per weight
  byte and the instructions per code vector (2.6 at 64 code rows, 2.8 at 32, 3.4 at 16; block_m 16).
* The code bytes (HBM) arrive STAGES - 1 trips ahead through a ring of shared-memory slots filled by cp.async,
  x (an L2 hit) one trip ahead through two slots (XOR-swizzled: `x_smem_layout`), the scale pairs with the codes
  (same commit group, [ROWS, 4] int16 per trip, 4-byte copies: `scale_copy_layout`) and a barrier per trip after
  the wait (the copying lanes are not the reading ones). Until 2026-12-06 the scales came one trip ahead in
  registers (gl.load): ptxas sank those loads next to their use, and Nsight Compute at T=256 put half of the
  1-warp kernel's stall cycles on long scoreboard (docs/PERF.md); the SASS loop now holds no LDG. Shared memory
  per program at the
  defaults: 20 KB at block_m 16 (11 programs per SM), 28 KB at block_m 32 (8 per SM);
  codes in flight per SM: 2 trips x 4 KB x 11 = 88 KB gate/up, against the ~30-40 KB that 3.35-4.8 TB/s needs
  at ~1.5 us of latency over 132 SMs.
* Instruction budget per 16-byte code vector (one row, one group, one trip): 1 cp.async + 1 LDS.128, one scale
  LDS.U16 per two vectors (and a 4-byte cp.async per two rows), 4 inline-PTX word decodes (w4a16_gluon_gemm._DECODE_WORD_ASM: 10 integer instructions and 4 HMUL2 each)
  and block_m / 8 HMMAs shared by 16 rows; tools/inspect_moe_sm90.py prints the SASS mix of the hot loop
  against the Triton kernel's.

Numerics are the Triton kernel's fp16 path: A = code * 2^-14 * s * 2^5 (exact in fp16), B = fp16(x * 2^-8)
(x_pre: the caller's operand; bf16 x is converted in registers), fp32 accumulation, times
s_global * FP16_ACC_FACTOR; gated: silu(gate) * up, times 2^-8 into an fp16 output (the down projection's
operand) or rounded to bf16; down: times the router weight, scattered to the assignment's row. Pad rows are
never written; blocks past the last expert exit at once. Gluon compiles for sm_90 only (no interpreter path):
`emulate` (the decode and K order) and `emulate_launch` (the block contract) run on the CPU tests, the GPU
tests run the kernel.
"""
from __future__ import annotations

import os

import torch
import triton

from .layouts import PreparedFP4Weight
from .w4a16_gemm import FP16_ACC_FACTOR

TRIP_K = 128          # K per loop trip: 4 packing groups (64 code bytes of a row), group t on lane bit t
BLOCK_MS = (8, 16, 32)   # sorted rows per block: 1-4 n8 tiles of the MMA's N
RING_STAGES = 3       # cp.async ring slots: trips prefetched = stages - 1

try:  # Gluon ships with Triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

    from .w4a16_gluon_gemm import HAVE_GLUON
    if HAVE_GLUON:
        from .kv_decode_gluon import _decode
except Exception:  # pragma: no cover - an old Triton: the Triton kernel keeps every call
    HAVE_GLUON = False


def supported(fmt: str, block_m: int, k: int, rows: int = 32, on_gpu: bool = True, warps: int = 1) -> bool:
    """Whether the Gluon kernel takes the call: NVFP4, block_m 8/16/32, K a multiple of 128, 1, 2 or 4 warps of
    16-128 rows each (powers of 2), Gluon importable, a CUDA tensor and no interpreter."""
    return (HAVE_GLUON and fmt == "nvfp4" and block_m in BLOCK_MS and k % TRIP_K == 0 and warps in (1, 2, 4)
            and rows % warps == 0 and rows // warps in (16, 32, 64, 128) and on_gpu
            and os.environ.get("TRITON_INTERPRET", "0") != "1")


def default_rows(gated: bool, block_m: int) -> int:
    """Weight rows per warp, the most without spills on sm_90a (tools/inspect_moe_sm90.py): gate/up 32 (+ 32
    up rows; 64 spill at block_m 32), down 64. Fewer rows per warp (16) take ~105-115 registers gated and ~70
    down instead of ~165-180: 16-28 warps per SM instead of 8-12 (docs/PERF.md, second session of 2026-12-06)."""
    return 32 if gated else 64


def takes(x: torch.Tensor, w: PreparedFP4Weight, y: torch.Tensor, block_m: int, rows: int, warps: int = 1) -> bool:
    """`supported`, and tensors the kernel can copy as 16-byte vectors: 16-bit x with unit inner stride and
    16-byte aligned rows, a 16-bit output, scale rows and experts 8-byte aligned (the kernel's 4-byte cp.async
    of scale pairs assumes it: stride // 4 * 4)."""
    return (supported(w.fmt, block_m, w.k, rows, x.is_cuda, warps) and x.dtype in (torch.float16, torch.bfloat16)
            and y.dtype in (torch.float16, torch.bfloat16) and x.stride(-1) == 1 and x.stride(0) % 16 == 0
            and x.data_ptr() % 16 == 0 and y.stride(-1) == 1 and w.scales.stride(-1) == 1
            and w.scales.stride(1) % 8 == 0 and w.scales.stride(0) % 8 == 0 and w.scales.data_ptr() % 8 == 0)


def k_order() -> torch.Tensor:
    """Physical K offset (inside a 128-wide trip) of each logical MMA K position (module docstring)."""
    k = torch.arange(TRIP_K)
    j0, gr, j1, j2, j3, h = k & 1, (k >> 1) & 3, (k >> 3) & 1, (k >> 4) & 1, (k >> 5) & 1, k >> 6
    return 32 * gr + 16 * h + 8 * j3 + 4 * j2 + 2 * j1 + j0


def emulate(x: torch.Tensor, w: PreparedFP4Weight, expert: int) -> torch.Tensor:
    """fp32 [T, N] = the kernel's arithmetic for rows x [T, K] against expert `expert` of w: each trip's code
    bytes decoded as the lanes see them (group t: byte j -> elements j and 16 + j, times the block scales, the
    fp16 bits of w4a16_gluon_gemm's decode), A and x both reordered by k_order, fp16(x * 2^-8) operand, fp32
    sum, times s_global * FP16_ACC_FACTOR. Equal to x @ dequant(W)^T up to fp32 order when the algebra is right."""
    q = w.qweight[expert].to(torch.int32)
    n, k = q.shape[0], q.shape[1] * 2
    # fp16 bits of code * 2^-14 for the low and the high nibble (w4a16_gluon_gemm._code_fp16_bits)
    lo, hi = ((u.to(torch.int16).view(torch.float16).float()
               for u in ((q << 8) & 0x8E00, ((q << 5) & 0x0E00) | ((q << 15) & 0x8000))))
    codes = torch.stack((lo, hi), -1).view(n, k // 32, 16, 2)           # [N, group, byte j, h]
    s = w.scales[expert].view(n, k // 32, 2).to(torch.int32)            # [N, group, h] prepared bytes
    s_f = ((s << 7).to(torch.int16).view(torch.float16)).float()        # s * 2^5
    a = (codes * s_f.unsqueeze(2)).permute(0, 1, 3, 2).reshape(n, k)   # physical K order: 32 g + 16 h + j
    order = (torch.arange(k // TRIP_K)[:, None] * TRIP_K + k_order()[None, :]).reshape(-1)
    xo = (x.float() * 2.0 ** -8).to(torch.float16).float()[:, order]
    acc = xo @ a[:, order].t()
    return acc * (w.global_scale[expert].float() * FP16_ACC_FACTOR)


def emulate_launch(x: torch.Tensor, w: PreparedFP4Weight, y: torch.Tensor, routing, topk_w, gated: bool) -> None:
    """What `launch` writes into y, block by block on the CPU (`emulate` per expert): x is the fp16 operand
    (x * 2^-8) or bf16 x; gated: y[sorted row] = silu(gate) * up (times 2^-8 into an fp16 y), gate rows 0..F-1
    and up rows F..2F-1 of w; down: y[assign] = topk_w[assign] * (x[sorted row] . W_e); pad rows and blocks
    with expert -1 untouched. The CPU tests run the pipeline through it against the reference."""
    xs = x.float() * 256.0 if x.dtype == torch.float16 else x.float()    # emulate takes x and scales it
    f = w.n // 2
    bm = routing.block_m
    for blk, e in enumerate(routing.block_expert.tolist()):
        if e < 0:
            continue
        rows = torch.arange(blk * bm, (blk + 1) * bm)
        assign = routing.sorted_ids[rows].long()
        valid = assign < routing.n_assign
        rows, assign = rows[valid], assign[valid]
        if gated:
            acc = emulate(xs[assign // routing.top_k], w, e)
            out = torch.nn.functional.silu(acc[:, :f]) * acc[:, f:]
            y[rows] = (out * (2.0 ** -8) if y.dtype == torch.float16 else out).to(y.dtype)
        else:
            y[assign] = (emulate(xs[rows], w, e) * topk_w[assign].float()[:, None]).to(y.dtype)


if HAVE_GLUON:
    @gluon.constexpr_function
    def x_layout(block_m, warps=1, copy=False):
        """[block_m, 4 (group gr), 32 (element e)] activations of one trip: lane (g, t) -> token row g, group t;
        registers: the 32 contiguous elements (four 16-byte vectors), then token rows + 8, + 16. Several warps
        read all of it (the MMA's B is every warp's); copy=True: the copy into shared memory, its last register
        bases split over the warps instead (each byte copied once)."""
        reg = [[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 0, 16]]
        r = 8
        while r < block_m:
            reg.append([r, 0, 0])
            r *= 2
        warp = []
        w = 1
        while w < warps:
            warp.append(reg.pop() if copy else [0, 0, 0])
            w *= 2
        lane = [[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]]
        return gl.DistributedLinearLayout(reg, lane, warp, [], [block_m, 4, 32])

    @gluon.constexpr_function
    def code_layout(rows, warps=1):
        """[rows, 4 (group gr), 4 (word w)] int32 code words as the MMA's A fragments want them: lane (g, t) -> rows
        g, group t; registers: the 4 words of the group (one 16-byte load), row + 8; warps: 16-row slabs; then
        rows + 16 * warps ... in registers (kv_decode_gluon._k_layout at one warp)."""
        reg = [[0, 0, 1], [0, 0, 2], [8, 0, 0]]
        warp = []
        r = 16
        while r < 16 * warps:
            warp.append([r, 0, 0])
            r *= 2
        while r < rows:
            reg.append([r, 0, 0])
            r *= 2
        lane = [[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]]
        return gl.DistributedLinearLayout(reg, lane, warp, [], [rows, 4, 4])

    @gluon.constexpr_function
    def scale_copy_layout(rows, warps=1):
        """[rows, 4] int16 scale pairs of one trip as cp.async copies them: each thread 4 bytes (2 groups of one
        row; cp.async's smallest unit), threads over rows, then warps; a small tile repeats over threads (copied
        twice: harmless)."""
        return gl.BlockedLayout([1, 2], [16, 2], [warps, 1], [1, 0])

    @gluon.constexpr_function
    def x_smem_layout(block_m):
        """The x tile [block_m, 4, 32] in shared memory: row-major 16-bit elements (token row n: 256 bytes, group
        gr: 64) with the 16-byte chunk index c = e // 8 stored as c ^ (gr1 + 2 n0). One phase of an LDS.128
        (8 lanes: groups 0-3 of token rows g, g + 1) then covers all 32 banks once; row-major, groups 0 and 2
        and rows g and g + 1 collide (4-way). Bases: the tile coordinate of each offset bit (XOR-linear)."""
        bases = [[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 0, 16], [0, 1, 0], [0, 2, 8], [1, 0, 16]]
        r = 2
        while r < block_m:
            bases.append([r, 0, 0])
            r *= 2
        return gl.SharedLinearLayout(bases)

    @gluon.jit
    def _fill_slot(wg_s, sg_s, wu_s, su_s, slot, trip, wg_ptr, sgc_ptr, wu_ptr, suc_ptr, GATED: gl.constexpr):
        """Ring slot `slot` <- trip `trip`'s code words and scale pairs (gate, and up when GATED): one commit group."""
        async_copy.async_copy_global_to_shared(wg_s.index(slot), wg_ptr + trip * 16)
        async_copy.async_copy_global_to_shared(sg_s.index(slot), sgc_ptr + trip * 4)
        if GATED:
            async_copy.async_copy_global_to_shared(wu_s.index(slot), wu_ptr + trip * 16)
            async_copy.async_copy_global_to_shared(su_s.index(slot), suc_ptr + trip * 4)
        async_copy.commit_group()

    @gluon.jit
    def _a_operand(words, pairs, ROWS: gl.constexpr, a_op: gl.constexpr):
        """[ROWS, 4, 4] code words + [ROWS, 4] scale pairs -> fp16 A [ROWS, 128] in the logical K order."""
        a = gl.permute(gl.reshape(_decode(words, pairs), [ROWS, 4, 2, 2, 2, 2, 2]), [0, 6, 2, 3, 5, 1, 4])
        return gl.convert_layout(gl.reshape(a, [ROWS, 128]), a_op, assert_trivial=True)

    @gluon.jit
    def _b_operand(xs, X_PRE: gl.constexpr, BLOCK_M: gl.constexpr, b_op: gl.constexpr):
        """[BLOCK_M, 4, 32] activations (fp16 x * 2^-8, or bf16 x) -> fp16 B [128, BLOCK_M], logical K order."""
        if not X_PRE:
            xs = (xs.to(gl.float32) * (1.0 / 256.0)).to(gl.float16)
        b = gl.permute(gl.reshape(xs, [BLOCK_M, 4, 2, 2, 2, 2, 2]), [2, 3, 4, 5, 1, 6, 0])
        return gl.convert_layout(gl.reshape(b, [128, BLOCK_M]), b_op, assert_trivial=True)

    @gluon.jit(do_not_specialize=["n_assign"])
    def _moe_gluon_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, y_ptr, sorted_ids_ptr, block_expert_ptr, topk_w_ptr,
                          N, K, n_assign, stride_we, stride_wn, stride_se, stride_sn, stride_xm, stride_ym,
                          acc_factor, TOP_K: gl.constexpr, GATED: gl.constexpr, X_PRE: gl.constexpr,
                          OUT_SCALED: gl.constexpr, BLOCK_M: gl.constexpr, ROWS: gl.constexpr,
                          STAGES: gl.constexpr, WARPS: gl.constexpr):
        """Grid (block, ROWS-row tile of N), WARPS warps (16-row slabs of the tile each; one x tile for all). _moe_gemm_kernel's contract: GATED y[sorted row, n] =
        silu(x_tok . Wg[e, n]) * (x_tok . Wu[e, n]) (rows n and N + n of w); else y[assign, n] = topk_w[assign]
        * (x[sorted row] . W[e, n]). w_ptr: int32 code words [E, rows, K/8]; s_ptr: int16 scale pairs
        [E, rows, K/32] (strides in those units)."""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1],
                                                      instr_shape=[16, 8])
        a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        wl: gl.constexpr = code_layout(ROWS, WARPS)
        xl: gl.constexpr = x_layout(BLOCK_M, WARPS)
        xc: gl.constexpr = x_layout(BLOCK_M, WARPS, True)
        # x slots: 2 at one warp; 3 with several, so that one barrier per trip (after the copies land) also
        # orders every warp's reads of a slot before its refill two trips later
        X_SLOTS: gl.constexpr = 2 if WARPS == 1 else 3
        ring: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])

        pid_m = gl.program_id(0)
        pid_n = gl.program_id(1)
        expert = gl.load(block_expert_ptr + pid_m)
        if expert >= 0:
            # addresses of trip 0: code words [ROWS, 4, 4], scale pairs [ROWS, 4], activations [BLOCK_M, 4, 32].
            # Rows past N and pad tokens read valid rows (no masks: the loads stay vectors); never stored.
            rows = gl.minimum(pid_n * ROWS + gl.arange(0, ROWS, gl.SliceLayout(1, gl.SliceLayout(2, wl))), N - 1)
            grs = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(2, wl)))
            wds = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(1, wl)))
            w_off = gl.expand_dims(gl.expand_dims(rows * stride_wn, 1) + gl.expand_dims(grs * 4, 0), 2) \
                + gl.expand_dims(gl.expand_dims(wds, 0), 1)
            e64 = expert.to(gl.int64)
            wg_ptr = w_ptr + e64 * stride_we + w_off
            wu_ptr = wg_ptr + N * stride_wn            # up rows F + n (gated only)
            toks = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, gl.SliceLayout(1, gl.SliceLayout(2, xc)))
            if GATED:
                x_rows = gl.minimum(gl.load(sorted_ids_ptr + toks), n_assign - 1) // TOP_K
            else:
                x_rows = toks
            xg = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(2, xc)))
            xe = gl.arange(0, 32, gl.SliceLayout(0, gl.SliceLayout(1, xc)))
            xr_ptr = x_ptr + gl.expand_dims(gl.expand_dims(x_rows.to(gl.int64) * stride_xm, 1), 2) \
                + gl.expand_dims(gl.expand_dims(xg * 32, 0), 2) + gl.expand_dims(gl.expand_dims(xe, 0), 1)

            # the scale pairs ride the code ring: [ROWS, 4] int16 per trip (8 contiguous bytes per row), copied in
            # the codes' commit group by lanes other than the readers (a barrier after the wait orders them)
            sl: gl.constexpr = scale_copy_layout(ROWS, WARPS)
            s_rows = gl.minimum(pid_n * ROWS + gl.arange(0, ROWS, gl.SliceLayout(1, sl)), N - 1)
            s_grs = gl.arange(0, 4, gl.SliceLayout(0, sl))
            # K % 128 == 0: the strides are multiples of 4 pairs (8 bytes); the // 4 * 4 tells the compiler so
            # at any K (the down projection's K/32 = 24 is not specialized as a multiple of 16)
            sn4 = stride_sn // 4 * 4
            sc_off = gl.expand_dims(s_rows * sn4, 1) + gl.expand_dims(s_grs, 0)
            sgc_ptr = s_ptr + e64 * (stride_se // 4 * 4) + sc_off
            suc_ptr = sgc_ptr + N * sn4
            s_ring: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
            sg_s = gl.allocate_shared_memory(gl.int16, [STAGES, ROWS, 4], s_ring)
            su_s = gl.allocate_shared_memory(gl.int16, [STAGES if GATED else 1, ROWS, 4], s_ring)
            wg_s = gl.allocate_shared_memory(gl.int32, [STAGES, ROWS, 4, 4], ring)
            wu_s = gl.allocate_shared_memory(gl.int32, [STAGES if GATED else 1, ROWS, 4, 4], ring)
            # x (an L2 hit: the gathered activations or the intermediate just written) one trip ahead;
            # the codes (from HBM) STAGES - 1 trips ahead. Commit order: X0, C0 .. C(S-2), then per trip i
            # X(i+1), C(i+S-1); trip i needs X(i) and C(i): all but the 3 groups after X(i) (2 when S = 2).
            x_s = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [X_SLOTS, BLOCK_M, 4, 32],
                                            x_smem_layout(BLOCK_M))
            trips = K // 128                   # TRIP_K
            last = trips - 1
            async_copy.async_copy_global_to_shared(x_s.index(0), xr_ptr)
            async_copy.commit_group()
            for st in gl.static_range(STAGES - 1):     # trips 0 .. STAGES - 2 (a trip past the end rereads
                _fill_slot(wg_s, sg_s, wu_s, su_s, st, gl.minimum(st, last),     # the last one: never used)
                           wg_ptr, sgc_ptr, wu_ptr, suc_ptr, GATED)
            acc_g = gl.zeros([ROWS, BLOCK_M], gl.float32, mma)
            acc_u = gl.zeros([ROWS, BLOCK_M], gl.float32, mma)
            for i in range(0, trips):
                async_copy.async_copy_global_to_shared(x_s.index((i + 1) % X_SLOTS),
                                                       xr_ptr + gl.minimum(i + 1, last) * 128)
                async_copy.commit_group()
                _fill_slot(wg_s, sg_s, wu_s, su_s, (i + STAGES - 1) % STAGES,    # the slot trip i - 1 read
                           gl.minimum(i + STAGES - 1, last), wg_ptr, sgc_ptr, wu_ptr, suc_ptr, GATED)
                if STAGES >= 3:
                    async_copy.wait_group(3)
                else:
                    async_copy.wait_group(2)
                gl.thread_barrier()                # other lanes' (warps') scale pairs and x(i) have landed too
                slot = i % STAGES
                b = _b_operand(x_s.index(i % X_SLOTS).load(xl), X_PRE, BLOCK_M, b_op)
                sg = sg_s.index(slot).load(gl.SliceLayout(2, wl))
                acc_g = mma_v2(_a_operand(wg_s.index(slot).load(wl), sg, ROWS, a_op), b, acc_g)
                if GATED:
                    su = su_s.index(slot).load(gl.SliceLayout(2, wl))
                    acc_u = mma_v2(_a_operand(wu_s.index(slot).load(wl), su, ROWS, a_op), b, acc_u)
            async_copy.wait_group(0)

            rows_c: gl.constexpr = gl.SliceLayout(1, mma)
            cols_c: gl.constexpr = gl.SliceLayout(0, mma)
            n_idx = pid_n * ROWS + gl.arange(0, ROWS, rows_c)
            t_idx = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, cols_c)
            assign = gl.load(sorted_ids_ptr + t_idx)
            valid = assign < n_assign
            factor = gl.load(gs_ptr + expert) * acc_factor
            gate = acc_g * factor
            if GATED:
                out = gate / (1.0 + gl.exp(-gate)) * (acc_u * factor)
                if OUT_SCALED:
                    out = out * (1.0 / 256.0)
                y_rows = t_idx
            else:
                tw = gl.load(topk_w_ptr + assign, mask=valid, other=0.0).to(gl.float32)
                out = gate * gl.expand_dims(tw, 0)
                y_rows = assign
            mask = gl.expand_dims(n_idx < N, 1) & gl.expand_dims(valid, 0)
            gl.store(y_ptr + gl.expand_dims(y_rows.to(gl.int64) * stride_ym, 0) + gl.expand_dims(n_idx, 1),
                     out.to(y_ptr.dtype.element_ty), mask=mask)


def kernel_args(x: torch.Tensor, w: PreparedFP4Weight, y: torch.Tensor, sorted_ids: torch.Tensor,
                block_expert: torch.Tensor, topk_w, n_assign: int, top_k: int, block_m: int, gated: bool,
                rows: int, stages: int = RING_STAGES, warps: int = 1) -> dict:
    """The kernel's arguments by name (the launch and tools/inspect_moe_sm90.py, which compiles on a CPU)."""
    words = w.qweight.view(torch.int32)      # [E, rows, K/8]: K % 128 == 0 keeps rows 16-byte aligned
    pairs = w.scales.view(torch.int16)       # [E, rows, K/32]
    return dict(x_ptr=x, w_ptr=words, s_ptr=pairs, gs_ptr=w.global_scale, y_ptr=y, sorted_ids_ptr=sorted_ids,
                block_expert_ptr=block_expert, topk_w_ptr=topk_w if topk_w is not None else w.global_scale,
                N=w.n // 2 if gated else w.n, K=w.k, n_assign=n_assign, stride_we=words.stride(0),
                stride_wn=words.stride(1), stride_se=pairs.stride(0), stride_sn=pairs.stride(1),
                stride_xm=x.stride(0), stride_ym=y.stride(0), acc_factor=FP16_ACC_FACTOR, TOP_K=top_k,
                GATED=gated, X_PRE=x.dtype == torch.float16, OUT_SCALED=y.dtype == torch.float16,
                BLOCK_M=block_m, ROWS=rows, STAGES=stages, WARPS=warps)


def launch(x: torch.Tensor, w: PreparedFP4Weight, y: torch.Tensor, routing, topk_w, gated: bool, rows: int,
           stages: int = RING_STAGES, warps: int = 1) -> torch.Tensor:
    """moe_grouped_gemm._launch's contract on this kernel (the caller checked `supported`). No host sync, no
    allocation: CUDA-graph capturable."""
    if x.stride(-1) != 1 or x.stride(0) % 16 or x.data_ptr() % 16:
        raise ValueError("the Gluon MoE kernel copies activation rows as 16-byte vectors: x needs contiguous, "
                         "16-byte aligned rows")
    n = w.n // 2 if gated else w.n
    grid = (routing.num_blocks, triton.cdiv(n, rows))
    _moe_gluon_kernel[grid](**kernel_args(x, w, y, routing.sorted_ids, routing.block_expert, topk_w,
                                          routing.n_assign, routing.top_k, routing.block_m, gated, rows, stages,
                                          warps), num_warps=warps)
    return y
