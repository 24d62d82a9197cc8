"""The implicit-GEMM engine: a K-tiled, multi-stage pipelined tensor-core convolution.

The conv is a GEMM with M = output positions of the whole batch (samples x depth x height x width,
flattened), N = output channels and K = taps x input channels. A block owns a BM x BN tile of the
output and walks K in chunks of BK: each chunk's input (A, [BK][BM]) and weights (B, [BN][BK]) are
copied to shared memory by cp.async into one of STAGES buffers, so the copies of the next
STAGES - 1 chunks are in flight while the tensor cores work on the current one. Each warp computes
a (16 WM) x (8 WN) tile with mma.sync m16n8k8 (TF32 inputs, fp32 accumulation); in fp32 mode each
operand is split into a TF32 part and its remainder (3xTF32), which keeps fp32 accuracy. The
pointwise epilogue runs on the accumulators, which are written straight to the output.

K is ordered tap-major: k = tap * CIP + ci, with the input channels padded to CIP. When BK divides
the channels, a chunk lies in one tap, so its validity (padding) and offset are one check per
thread per chunk; with few channels (CIP < BK) a chunk covers BK / CIP taps. The weights are taken
in that order too: the launch hands the kernel a copy permuted to [C_OUT][TAPS_PAD][CIP] (zeros in
the padding), made once per weight version.

On Hopper (sm_90, built as sm_90a) the products can run on `wgmma` instead: each warpgroup of
four warps multiplies its 64 positions by all BN channels in one instruction per k-step, reading
B straight from shared memory (128-byte swizzled rows, rounded or split into hi and lo parts once
per chunk by the threads that copied them) and A from registers. The planner takes it where a
sweep of real layers found it faster (`default_config`); `specgen tune` tries both.

Every extent, tile and trip count is a compile-time constant; only the batch is read at run time
(it sizes the grid and bounds M).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specgen import splitk, target as targets
from specgen.target import BLOCK_RESERVED_SMEM
from specgen.spec import LayerSpec

# Left to the planner, a transposed conv runs its stride phases here from this many input channels;
# with fewer, a phase's K is a handful of taps x channels and the FFMA gather is as fast.
TRANSPOSED_MIN_CHANNELS = 16
INT32_MAX = (1 << 31) - 1


@dataclass(frozen=True)
class IgemmConfig:
    """The tunable shape of the kernel: warps per block along M and N, m16-tiles and n8-tiles per
    warp, the K chunk, the pipeline depth and the blocks per SM asked of the compiler (0: as
    shared memory and an estimate of the registers allow)."""

    warps_m: int
    warps_n: int
    wm: int
    wn: int
    bk: int
    stages: int
    min_blocks: int = 0
    # Hopper's warpgroup MMA (wgmma, sm_90a): each warpgroup of 4 warps computes 64 positions x BN
    # channels per instruction, B read straight from (swizzled) shared memory; warps_m = 4 x the
    # warpgroups, wm = 1, warps_n = 1, wn = BN / 8, bk = 32.
    wgmma: bool = False
    # A transposed conv with stride 2 along W: 0 lets the planner decide (`pairs_w`: pairs where
    # shared memory holds their stash), 1 runs one stride phase per block, 2 a W pair per block.
    phases_per_block: int = 0
    # The split kernel's parts of K (`specgen.splitk`): 0 lets the planner decide, 1 has none,
    # otherwise a divisor of the K chunks (a plain conv only: a transposed conv's phases have none).
    split_k: int = 0

    @property
    def bm(self) -> int:
        return self.warps_m * self.wm * 16

    @property
    def bn(self) -> int:
        return self.warps_n * self.wn * 8

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n


@dataclass(frozen=True)
class Phase:
    """One stride phase of a transposed conv: the outputs o = OUT_OFF + S * j (per dim, j < OP)
    see only the taps k = FIRST + S * t (t < KP), each reading input j + IN_OFF - t. The phase is a
    plain stride-1 GEMM of its own: M = its positions, K = its taps x the input channels."""

    index: int
    out_off: tuple[int, int, int]  # the phase's first output (d, h, w)
    op: tuple[int, int, int]  # outputs along each dim (the phase's grid)
    kp: tuple[int, int, int]  # its taps along each dim
    in_off: tuple[int, int, int]  # input of tap 0 at j = 0
    positions: int  # prod(op)
    taps: int  # prod(kp)
    taps_pad: int  # taps padded to a multiple of TPC
    k_tiles: int  # K chunks (0: a phase no tap reaches: bias and epilogue only)
    w_offset: int  # where its weights start in the permuted copy (floats)
    tap_index: tuple[int, ...]  # the conv's flat tap (kd * K_H * K_W + kh * K_W + kw) of each of its taps
    # The width of its M grid: op[2], or in a W pair (`IgemmPlan.w_pairs`) the pair's wider phase's
    # (the narrower one computes a column past its last output and does not store it).
    grid_w: int = 0

    @property
    def grid_positions(self) -> int:
        """M per sample: the positions of its grid."""
        return self.op[0] * self.op[1] * (self.grid_w or self.op[2])


def phase_dims(kernel3, stride3, padding3, out3) -> list[list[tuple[int, int, int, int, int]]]:
    """Per dim (d, h, w), its stride phases that have outputs: (phi, OP outputs, FIRST tap, KP taps,
    IN_OFF). Output o = phi + S * j meets tap k when (o + P - k) is a multiple of S, i.e.
    k = FIRST + S * t with FIRST = (phi + P) mod S, reading input j + IN_OFF - t, IN_OFF = (phi + P - FIRST) / S."""
    per_dim = []
    for k, s, p, out in zip(kernel3, stride3, padding3, out3):
        dim = []
        for phi in range(s):
            op = (out - phi + s - 1) // s
            if op <= 0:
                continue
            first = (phi + p) % s
            dim.append((phi, op, first, max(0, -(-(k - first) // s)), (phi + p - first) // s))
        per_dim.append(dim)
    return per_dim


def stride_phases(kernel3, stride3, padding3, out3, cip: int, tpc: int, bk: int, cout: int,
                  w_pairs: bool = False) -> tuple[Phase, ...]:
    """The phases of a transposed conv (dilation 1) with 3-dim geometry, the most taps first, empty
    ones (a dim with fewer outputs than its stride) left out. Output o = phi + S * j meets tap k
    when (o + P - k) is a multiple of S, i.e. k = (phi + P) mod S + S * t, reading input
    (o + P - k) / S = j + (phi + P - FIRST) / S - t. With `w_pairs` (stride 2 along W, see
    `pairs_w`) the two W phases of each (d, h) phase are neighbours, W phase 0 first, on one M grid
    (the wider one's), the pairs with the most taps first."""
    per_dim = phase_dims(kernel3, stride3, padding3, out3)
    # The phases with the most taps first (each M tile's phases are neighbours in the grid).
    if w_pairs:
        groups = sorted(([(d, h, w) for w in per_dim[2]] for d in per_dim[0] for h in per_dim[1]),
                        key=lambda g: -sum(c[0][3] * c[1][3] * c[2][3] for c in g))
        combos = [c for g in groups for c in g]
        grid_w = max(w[1] for w in per_dim[2])
    else:
        combos = sorted(((d, h, w) for d in per_dim[0] for h in per_dim[1] for w in per_dim[2]),
                        key=lambda c: -(c[0][3] * c[1][3] * c[2][3]))
        grid_w = 0
    phases, offset = [], 0
    for d, h, w in combos:
        kp = (d[3], h[3], w[3])
        taps = kp[0] * kp[1] * kp[2]
        taps_pad = -(-taps // tpc) * tpc
        index = tuple(
            ((d[2] + stride3[0] * td) * kernel3[1] + h[2] + stride3[1] * th) * kernel3[2] + w[2] + stride3[2] * tw
            for td in range(kp[0]) for th in range(kp[1]) for tw in range(kp[2])
        )
        phases.append(Phase(
            index=len(phases), out_off=(d[0], h[0], w[0]), op=(d[1], h[1], w[1]), kp=kp,
            in_off=(d[4], h[4], w[4]), positions=d[1] * h[1] * w[1], taps=taps, taps_pad=taps_pad,
            k_tiles=taps_pad * cip // bk, w_offset=offset, tap_index=index, grid_w=grid_w,
        ))
        offset += cout * taps_pad * cip
    return tuple(phases)


def _lds(cfg: "IgemmConfig") -> tuple[int, int]:
    """Row strides of A and B in shared memory: BM + 8 and BK + 4 (a fragment's lanes hit 32
    banks); wgmma's B rows are 128 bytes, swizzled, unpadded."""
    return cfg.bm + 8, (cfg.bk if cfg.wgmma else cfg.bk + 4)


def _smem_bytes(cfg: "IgemmConfig", split: bool, w_pairs: bool) -> int:
    """The pipeline's buffers; wgmma's B stages (and 3xTF32's lo parts) 1024-byte aligned (one
    more KB to align the base); a W pair's stash of the first GEMM's BM x BN sums."""
    lda, ldb = _lds(cfg)
    smem = 4 * cfg.stages * (cfg.bk * lda + cfg.bn * ldb)
    if cfg.wgmma:
        smem += 1024 + (2 * 4 * cfg.bn * ldb if split else 0)
    return smem + (4 * cfg.bm * cfg.bn if w_pairs else 0)


def pairs_w(stride3, out3, cfg: "IgemmConfig", split: bool, target: targets.Target) -> bool:
    """Whether a transposed conv's two W phases run in one block: stride 2 along W and at least 2
    outputs there, and the config asks for pairs or leaves it to the planner, which also wants
    their stash to fit (the first GEMM's BM x BN sums wait in shared memory while the second runs)
    and 160 registers a thread (a 16-warp tile's 128 spilled in 3xTF32: the pair's code holds two
    GEMMs and the stash's moves).
    Each thread then stores its positions' outputs 2j and 2j + 1 side by side (8 bytes). A phase
    alone writes every other float of a line: its 32-byte sectors reach the L2 half written and
    lean on the other phase's half arriving before the line leaves (where the phases' grids differ
    by a column, as with an odd output width, they never meet and each sector costs a read of DRAM
    as well). Measured on KernelBench's stride-2 layers: 1.1-1.7x in TF32, up to 1.1x in 3xTF32."""
    if cfg.phases_per_block == 1 or stride3[2] != 2 or out3[2] < 2:
        return False
    if cfg.phases_per_block == 2:
        return True
    return _smem_bytes(cfg, split, True) <= target.smem_per_block and target.regs_per_sm // cfg.threads >= 160


@dataclass(frozen=True)
class IgemmPlan:
    """Everything the igemm template needs beyond the shared plan values."""

    config: IgemmConfig
    bm: int
    bn: int
    bk: int
    stages: int
    threads: int
    cip: int  # input channels padded (a multiple of 8 or a power of two dividing BK)
    taps_pad: int  # taps padded to a multiple of TPC
    tpc: int  # taps per K chunk (1 when BK divides CIP)
    cpt: int  # K chunks per tap (1 when TPC > 1)
    k_pad: int  # TAPS_PAD * CIP
    k_tiles: int  # K chunks
    n_tiles: int  # blocks along N
    positions: int  # output positions per sample (M per sample)
    lda: int  # shared-memory row stride of A (BM + 8: lanes of a fragment load hit 32 banks)
    ldb: int  # ... of B (BK + 4)
    a_vec: int  # floats per A copy (4: 16-byte copies of 1 x 1 rows, else 1)
    a_iters: int  # A copies per thread per chunk
    a_row_step: int  # K rows between a thread's A copies
    b_iters: int  # 16-byte B copies per thread per chunk
    smem_bytes: int
    min_blocks: int
    split: bool  # 3xTF32 (fp32 mode) rather than plain TF32
    wgmma: bool  # warpgroup MMA with B from 128-byte-swizzled shared memory (sm_90a)
    # A transposed conv: one GEMM per stride phase, weights permuted phase by phase; `positions` is
    # then the largest phase's (the grid covers it).
    phases: tuple[Phase, ...] = ()
    w_pairs: bool = False  # each block runs the two W phases of a (d, h) phase (`pairs_w`)
    # Split K (`specgen.splitk`): `<kernel>_split` walks 1 / split_k of the K chunks per block into
    # a workspace, `<kernel>_reduce` adds the parts in order and runs the epilogue; 1: no such kernel.
    split_k: int = 1
    split_iters: int = 0  # K chunks per block of the split kernel
    cout: int = 0

    @property
    def grid_gemms(self) -> int:
        """What multiplies a M tile's blocks along N in the grid: the phases, or their W pairs."""
        return max(1, len(self.phases) // (2 if self.w_pairs else 1))


def why_not(spec: LayerSpec, levels: list, reductions: list) -> list[str]:
    """The reasons the engine cannot run this layer (empty: it can)."""
    reasons = []
    if spec.conv.groups > 1:
        reasons.append("the conv has groups")
    if getattr(spec.conv, "transposed", False) and any(d != 1 for d in spec.conv_geometry()["dilation"]):
        reasons.append("the transposed conv has a dilation")
    if len(levels) > 1:
        reasons.append("a pool follows the conv")
    if reductions:
        reasons.append("the epilogue reduces")
    return reasons


def _cip_and_bk(cin: int) -> tuple[int, int]:
    for bk in (32, 16, 8):
        if cin % bk == 0:
            return cin, bk
    if cin > 16:  # pad to a multiple of 8; chunks of the largest of 32, 16, 8 that divides it
        cip = -(-cin // 8) * 8
        return cip, next(bk for bk in (32, 16, 8) if cip % bk == 0)
    cip = 1 << max(0, (cin - 1).bit_length())  # 1, 2, 4, 8, 16
    return cip, max(8, min(32, 4 * cip))


def wgmma_config(cout: int, warpgroups: int, stages: int, max_bn: int = 256) -> IgemmConfig:
    """A wgmma tile: `warpgroups` x 64 positions x all (up to `max_bn`) channels, K chunks of 32."""
    bn = min(max_bn, -(-cout // 8) * 8)
    return IgemmConfig(4 * warpgroups, 1, 1, bn // 8, 32, stages, 1, True)


def has_wgmma(target) -> bool:
    """Hopper (sm_90): its kernels are built for sm_90a, where wgmma lives."""
    return target.arch in ("sm_90", "sm_90a")


def wgmma_fits(cin: int) -> bool:
    """wgmma's K chunks are 32 channels (128-byte rows): the padded channels must tile them."""
    cip, _ = _cip_and_bk(cin)
    return cip % 32 == 0 or 32 % cip == 0


def default_config(cout: int, cin: int, taps: int, split: bool, wgmma: bool = True) -> IgemmConfig:
    """The planner's guess, from sweeps of tile shapes on real layers (benchmarks/NOTES.md, v15-v16).
    On Hopper (`wgmma`), up to 128 channels in TF32 and up to 64 in 3xTF32: three warpgroups of
    wgmma over 192 positions x all channels. Otherwise mma.sync: up to 64 channels, 128 x 64 blocks
    of 32 x 32 warp tiles; more, 128 x 128 blocks: in TF32 of 64 x 32 warp tiles, K chunks of 16
    in 4 stages and two blocks per SM; in 3xTF32 (twice the fragment registers) of 16 warps with
    32 x 32 warp tiles."""
    cip, bk = _cip_and_bk(cin)
    if wgmma and wgmma_fits(cin) and cout <= (64 if split else 128):
        return wgmma_config(cout, 3, 3 if split else 4)
    if cout <= 32:
        return IgemmConfig(8, 1, 2, 4, bk, 3)  # 256 x 32
    if cout <= 64:
        return IgemmConfig(4, 2, 2, 4, bk, 3)  # 128 x 64
    if split:
        return IgemmConfig(4, 4, 2, 4, bk, 3)  # 128 x 128, 16 warps
    return IgemmConfig(2, 4, 4, 4, min(bk, 16), 4, min_blocks=2)  # 128 x 128, two blocks per SM


def planner_config(spec: LayerSpec, taps: int, target: targets.Target) -> IgemmConfig:
    """The tile the planner takes for `spec` on `target`: `default_config`, except that a transposed
    conv of stride 2 along W in TF32 or 16 bits runs its W pairs of stride phases (`pairs_w`) on
    128 positions x up to 64 channels, 8 warps (the fastest tile on KernelBench's stride-2 layers, v21)."""
    cin, cout = spec.input.channels, spec.conv.out_channels
    if spec.conv.transposed and spec.conv_geometry()["stride"][-1] == 2 and spec.precision != "fp32":
        return wgmma_config(cout, 2, 3, 64) if has_wgmma(target) and wgmma_fits(cin) else IgemmConfig(4, 2, 2, 4, _cip_and_bk(cin)[1], 3)
    return default_config(cout, cin, taps, spec.precision == "fp32", has_wgmma(target))


def plan_igemm(
    spec: LayerSpec, conv_out: tuple[int, int, int], taps: int, config: IgemmConfig | None = None,
    target: targets.Target = targets.DEFAULT,
) -> IgemmPlan:
    """The tiling for `config`, or the planner's guess. `target`'s shared memory per block and per SM
    bound the tile and the blocks per SM; Hopper targets (sm_90, built as sm_90a) get wgmma."""
    cin, cout = spec.input.channels, spec.conv.out_channels
    cfg = config or planner_config(spec, taps, target)
    if cfg.wgmma and not has_wgmma(target):
        raise ValueError(f"wgmma needs an sm_90 target, not {target.arch}")
    cip, _ = _cip_and_bk(cin)
    bk = cfg.bk
    if cip >= bk:
        if cip % bk:
            raise ValueError(f"K chunk {bk} does not divide the padded channels {cip}")
        tpc, cpt = 1, cip // bk
    else:
        if bk % cip:
            raise ValueError(f"padded channels {cip} do not divide the K chunk {bk}")
        tpc, cpt = bk // cip, 1
    taps_pad = -(-taps // tpc) * tpc
    k_pad = taps_pad * cip
    bm, bn, threads = cfg.bm, cfg.bn, cfg.threads
    geo = spec.conv_geometry()
    kw = geo["kernel"][-1]
    sw, pw = geo["stride"][-1], geo["padding"][-1]
    in_w = spec.input.size[-1]
    ow = conv_out[2]
    positions = math.prod(conv_out)
    # 16-byte A copies: four consecutive positions of one output row read four consecutive inputs
    # (a 1-wide kernel, stride 1, no padding along W), rows and samples aligned to 4.
    transposed = spec.conv.transposed
    phases: tuple[Phase, ...] = ()
    w_pairs = False
    if transposed:
        from specgen.plan import _spatial3  # (plan imports this module)

        stride3 = _spatial3(geo["stride"], 1)
        w_pairs = pairs_w(stride3, conv_out, cfg, spec.precision == "fp32", target)
        phases = stride_phases(_spatial3(geo["kernel"], 1), stride3, _spatial3(geo["padding"], 0),
                               conv_out, cip, tpc, bk, cout, w_pairs)
        positions = max(ph.grid_positions for ph in phases)
    a_vec = 4 if (not transposed and kw == 1 and sw == 1 and pw == 0 and in_w % 4 == 0 and ow == in_w and positions % 4 == 0
                  and (bm // 4) <= threads and threads % (bm // 4) == 0 and bk % (threads // (bm // 4)) == 0) else 1
    if a_vec == 1 and threads % bm:
        raise ValueError(f"{threads} threads cannot split rows of {bm} positions")
    a_cols = bm // a_vec
    a_row_step = threads // a_cols
    if bk % a_row_step:
        raise ValueError(f"K chunk {bk} is not a multiple of the {a_row_step} rows copied per pass")
    a_iters = bk // a_row_step
    b_chunks = bn * bk // 4
    b_iters = -(-b_chunks // threads)
    lda, ldb = _lds(cfg)
    if cfg.wgmma:
        if bk != 32 or cfg.wm != 1 or cfg.warps_n != 1 or cfg.warps_m % 4 or bn > 256 or bn % 8:
            raise ValueError("a wgmma tile needs K chunks of 32, one m16 row per warp, whole warpgroups and <= 256 channels")
        if spec.precision != "fp32" and cfg.stages < 3:
            raise ValueError("a TF32 wgmma pipeline needs 3 stages or more (one buffer stays with the tensor cores)")
    smem_bytes = _smem_bytes(cfg, spec.precision == "fp32", w_pairs)
    if smem_bytes > target.smem_per_block:
        raise ValueError(f"{smem_bytes} bytes of shared memory exceed the {target.smem_per_block} of a block on {target.arch}")
    regs = 4 * cfg.wm * cfg.wn + (2 if spec.precision == "fp32" else 1) * (4 * cfg.wm + 2 * cfg.wn) + 48
    min_blocks = cfg.min_blocks or (
        2 if 2 * (smem_bytes + BLOCK_RESERVED_SMEM) <= target.smem_per_sm and 2 * threads * max(regs, 64) <= target.regs_per_sm else 1
    )
    k_tiles, n_tiles = k_pad // bk, -(-cout // bn)
    if phases:
        if cfg.split_k > 1:
            raise ValueError("a transposed conv's stride phases have no split kernel")
        parts = 1
    else:
        parts = cfg.split_k or splitk.choose(positions, cout, bm, n_tiles, k_tiles, (target.sm_count or 132) * min_blocks)
        if k_tiles % parts:
            raise ValueError(f"split_k {parts} does not divide the {k_tiles} K chunks")
    return IgemmPlan(
        config=cfg, bm=bm, bn=bn, bk=bk, stages=cfg.stages, threads=threads, cip=cip, taps_pad=taps_pad, tpc=tpc,
        cpt=cpt, k_pad=k_pad, k_tiles=k_tiles, n_tiles=n_tiles, positions=positions, lda=lda, ldb=ldb,
        a_vec=a_vec, a_iters=a_iters, a_row_step=a_row_step, b_iters=b_iters, smem_bytes=smem_bytes,
        min_blocks=min_blocks, split=spec.precision == "fp32", wgmma=cfg.wgmma, phases=phases, w_pairs=w_pairs,
        split_k=parts, split_iters=k_tiles // parts, cout=cout,
    )


def describe(ig: IgemmPlan) -> str:
    mode = "3xTF32" if ig.split else "TF32"
    instr = f"wgmma m64n{ig.bn}k8, {ig.threads // 128} warpgroups" if ig.wgmma else "mma.sync m16n8k8"
    if ig.phases:
        chunks = "/".join(str(ph.k_tiles) for ph in ig.phases)
        pairs = "; a block runs both W phases and stores their outputs side by side" if ig.w_pairs else ""
        return (
            f"implicit GEMM on tensor cores ({mode} {instr}), one GEMM per stride phase of the transposed conv "
            f"({len(ig.phases)} phases, side by side in the grid{pairs}): block tile {ig.bm} positions x {ig.bn} channels, K chunks of {ig.bk} "
            f"({chunks} chunks per phase, {ig.stages}-stage cp.async pipeline), {ig.threads} threads"
        )
    return (
        f"implicit GEMM on tensor cores ({mode} {instr}): block tile {ig.bm} positions x {ig.bn} channels, "
        f"K chunks of {ig.bk} ({ig.k_tiles} chunks, {ig.stages}-stage cp.async pipeline), warp tile "
        f"{16 * ig.config.wm} x {8 * ig.config.wn}, {ig.threads} threads"
        + (f"; for small batches K split {ig.split_k} ways ({ig.split_iters} chunks a block), the parts added in "
           f"order by a second kernel" if ig.split_k > 1 else "")
    )
