"""The Hopper engine: an implicit GEMM fed by the tensor memory accelerator (TMA), on wgmma.

The conv is a GEMM with M = output positions of the whole batch (sample, d, h, w flattened), N =
output channels and K = taps x input channels, tap-major. Hopper can do all of its data movement
in hardware:

* The input is first laid out channels-last, [batch][d][h][w][CIP] with the channels padded to
  CIP, by a small layout kernel in the same .cu (`<kernel>_prep`). It also rounds the values for
  the tensor cores once (TF32: round to nearest; fp32 mode: split into a TF32 part and its
  remainder, two planes), so the main loop does no conversions. A channels-last bf16/fp16 input
  whose channels need no padding is read as it is; so is the NC(D)HW input of a bf16 / fp16 1x1
  conv without padding (`reads_nchw_in_place`), whose A tiles are then tiled loads of 64 positions x
  BKC channels that wgmma reads as a transposed (MN-major) operand (a strided one reads the input's
  subsampled copy, `TmaPlan.subsample`); so is that of a tf32 / fp32 one, whose tiles the producer
  warpgroup's idle warps transpose in shared memory (`TmaPlan.a_staged`).
* A K-block is (one tap, BKC channels). Its A tile, BM consecutive output positions x BKC
  channels, is one TMA load in im2col mode: the hardware walks the positions (across rows and
  samples), adds the tap's offset, and fills zeros where a tap falls in the padding. Its B tile
  (BN channels x BKC) is one TMA load of the weights, which the launch keeps permuted to
  [C_OUT][TAPS][CIP] (and rounded or split the same way). Both land swizzled (rows of 32, 64 or
  128 bytes) in the layout wgmma reads.
* One producer warp issues the loads of STAGES pipeline stages ahead; a stage's mbarrier counts
  the bytes in. Two consumer warpgroups each multiply BM / 2 positions by BN channels with
  `wgmma.mma_async` (both operands from shared memory), keeping one stage's products in flight,
  and give the stage back through a second mbarrier. The producer runs on few registers
  (`setmaxnreg`), the consumers on many (the accumulators).
* The epilogue (bias, the pointwise ops) runs on the accumulators, which are stored straight to
  the [batch][C_OUT][d][h][w] output. A reduction over the channels alone (sum, mean, amax, amin,
  logsumexp, and pointwise ops after it) is taken there too, when one block holds every channel
  (BN >= C_OUT, at most 256): each thread folds the channels it holds for a row, the four lanes that
  share the row join theirs by shuffles, and one of them writes the row's single value -- the conv's
  output never leaves the registers (`channel_reduction`). A softmax or log-softmax over the
  channels alone (`channel_norm`), after the pointwise ops and before any others, is taken there
  the same way: the row's max and sum of exponentials joined by shuffles among the quad, then
  every value normalized in its register and carried on through the ops after it (a reduction over
  the channels included) -- where the tail engine would write the conv's output, read it back for
  the statistics and again to normalize.
* A statistic stage over trailing spatial dims (a LayerNorm over W, or over H and W; a softmax
  over W; an instance norm of a small map; `row_norm`) after nothing but pointwise ops is taken
  there too, where a group is R whole consecutive rows of the tile (R a power of two from 16 to
  256, dividing BM: a conv's rows are its positions;
  a transposed conv of stride 2 along W, run as W pairs, has a group of R = W / 2 grid rows, each
  holding both of its W phases' outputs). Each warp folds a column's 16 rows by shuffles, writes the
  sum to shared memory, and after a barrier of the consumer warpgroups every thread adds its
  group's R / 16 sums in a fixed order: the mean (or max), then the same again for the second
  moment about it (or the sum of exponentials), then every value is normalized in its register,
  takes the norm's weight and bias at its place in the group, and the ops after it
  (`row_norm_rows`) -- where the tail engine would write the conv's output and read it back twice.

Precision modes: `tf32` (operands rounded to TF32 as PyTorch's default convolutions), `fp32`
(3xTF32: lo*hi + hi*lo + hi*hi, each stage summed apart and added to the total in fp32: the
tensor cores add with truncation), `bf16` / `fp16` (16-bit tensors in and out, fp32 accumulation
and epilogue).

Every extent, tile and trip count is a literal; only the batch is read at run time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from specgen import igemm, splitk, target as targets
from specgen.target import BLOCK_RESERVED_SMEM
from specgen.spec import LayerSpec

THREADS = 384  # one producer warpgroup, two consumer warpgroups
CONSUMER_THREADS = 256
PRODUCER_REGS, CONSUMER_REGS = 40, 232  # setmaxnreg: 128 x 40 + 256 x 232 <= 64 K registers
# Two blocks per SM (one's epilogue overlaps the other's loads and products): each is launched on
# at most 80 registers a thread (2 x 384 x 80 <= 64 K), the producer drops to 40 and the consumers
# rise to 96 (128 x 40 + 256 x 96 <= 384 x 80), which hold at most 64 accumulators a thread, in
# wgmma of at most n64 (ptxas cannot fit an m64n128 instruction's 64 operand registers under 80).
REGS_TWO_BLOCKS = {"producer": 40, "consumer": 96, "max_acc": 64, "max_bn": 64}
# Two blocks per SM only with a pipeline of 3 stages or more each (a transposed conv's blocks, which
# hold one tile each, excepted: TWO_BLOCK_TRANSPOSED_MIN_STAGES). Since every block walks tiles (its
# producer loading the next tile's stages while the consumers run this one's epilogue), two blocks of
# 2 stages lost to one block of 4 on every layer timed: `specgen tune` on an H100 at batch 64 (NOTES
# v64), 256 x 64 tiles in tf32, 3x3 64 -> 64 at 56^2 1.15x, the UNet's 32 -> 64 and 64 -> 64 at 64^2
# 1.14x, a 3-D 32 -> 64 1.09x, 192 -> 64 1.67x (v50); in bf16 two blocks of 128 x 64 and 4 stages
# were fastest (1.07x / 1.08x on 256 -> 64 1x1 and 64 -> 64 3x3), in tf32 one block of 256 rows
# (1.04x-1.11x over them).
TWO_BLOCK_MIN_STAGES = 3
TWO_BLOCK_TRANSPOSED_MIN_STAGES = 2
# A tile's cost per multiply-add falls with its size faster than the waves of tiles over the SMs
# grow: `cost` in `candidates` is waves x BM x BN x (1 + TILE_COST_N / BN + TILE_COST_M / BM), fitted
# to `specgen tune` on 47 TMA layers on an H100 (NOTES v64: the former 32 / 32 took 128 x 64 tiles
# for 256 channels at 14^2, 1.25x slower than 256 x 128 ones, which fill 98 of 132 SMs).
TILE_COST_N, TILE_COST_M = 64, 96
# The input rows the SMs' tiles read at once stay in L2 across a 3x3 conv's taps only while they
# fit: BM x the input channels' bytes x the tiles in flight above this, and the 9 taps read them
# from DRAM again. UNet's 384 -> 128 3x3 at 32^2 in tf32 (52 MB of rows at 256 x 128) ran 1.37x
# faster on 128 x 128 tiles (26 MB), where 256 channels (26-35 MB at 98-132 tiles) kept 256 x 128
# the fastest (NOTES v64; an H100 and an H200 have 50 MB of L2). Such tiles are tried last.
L2_WORKING_SET = 30_000_000  # bytes
SMEM_ALIGN = 1024  # a swizzle pattern repeats every 8 rows of up to 128 bytes
MAX_ACC = 128  # accumulator registers per consumer thread
MAX_REDUCED_CHANNELS = 256  # a reduction over the channels: one block's BN holds them all
# TMA im2col limits on the bounding box corners, by tensor rank (CUDA driver API).
CORNER_LIMIT = {3: 1 << 15, 4: 1 << 7, 5: 1 << 4}
INT32_MAX = (1 << 31) - 1

ELEM_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}
OPERAND_CTYPE = {"fp32": "float", "tf32": "float", "bf16": "__nv_bfloat16", "fp16": "__half"}
WGMMA_TYPE = {"fp32": "tf32", "tf32": "tf32", "bf16": "bf16", "fp16": "f16"}
# The swizzle of a K-major row of `bytes`: the wgmma descriptor's layout code and the tensor map's.
SWIZZLE = {128: {"desc": 1, "tma": 3}, 64: {"desc": 2, "tma": 2}, 32: {"desc": 3, "tma": 1}}


@dataclass(frozen=True)
class TmaConfig:
    """The tunable shape: BM positions (two warpgroups of BM / 2), BN channels, pipeline depth,
    K-blocks per stage, and the split kernel's parts of K (0: the planner's, `splitk.choose`; 1: no split
    kernel; otherwise a divisor of the stages walked)."""

    bm: int
    bn: int
    stages: int
    kb_per_stage: int
    split_k: int = 0
    blocks_per_sm: int = 1  # 2: smaller pipelines and fewer registers, two blocks sharing an SM
    # A transposed conv of stride 2 along W: 0 lets the planner decide (W pairs where `w_pairs_fit`),
    # 1 runs one stride phase per block, 2 the two W phases of a (d, h) phase per block.
    phases_per_block: int = 0

    def __post_init__(self):
        if self.bm not in (128, 256):
            raise ValueError(f"BM must be 128 or 256, got {self.bm}")
        if not (8 <= self.bn <= 256 and self.bn % 8 == 0):
            raise ValueError(f"BN must be a multiple of 8 in 8..256, got {self.bn}")
        if self.stages < 2 or self.kb_per_stage < 1:
            raise ValueError("a TMA pipeline needs 2 or more stages of 1 or more K-blocks")
        if self.split_k < 0:
            raise ValueError(f"split_k must be 0 (the planner's), 1 (none) or more, got {self.split_k}")
        if self.blocks_per_sm not in (1, 2):
            raise ValueError(f"blocks_per_sm must be 1 or 2, got {self.blocks_per_sm}")
        if self.phases_per_block not in (0, 1, 2):
            raise ValueError(f"phases_per_block must be 0 (the planner's), 1 or 2, got {self.phases_per_block}")


@dataclass(frozen=True)
class TmaPhase:
    """One stride phase of a transposed conv: the outputs o = OUT_OFF + S * j (per dim, j < OP)
    meet only the taps k = FIRST + S * t (t < KP), each reading input j + IN_OFF - t. With its taps
    reversed (t' = KP - 1 - t, the weights permuted to match) the phase is a plain stride-1 conv:
    output j reads input j + LOWER + t', LOWER = IN_OFF - (KP - 1) -- what an im2col tensor map
    whose box starts at LOWER walks. Every phase runs on one grid of positions (`TmaPlan.grid`,
    the largest phase's), so the same M tile of two phases covers the same region of the output
    and their stores, every S-th value of a row each, meet in the L2."""

    index: int
    out_off: tuple[int, int, int]  # its first output (d, h, w)
    op: tuple[int, int, int]  # its outputs along each dim
    kp: tuple[int, int, int]  # its taps along each dim
    lower: tuple[int, int, int]  # input of output 0, tap t' = 0 (d, h, w)
    taps: int  # prod(kp)
    tap_index: tuple[int, ...]  # the conv's flat tap of each of its taps t' (d, h, w nested, w fastest)
    lower_map: tuple[int, ...] = ()  # the im2col box's corners, W first (the conv's spatial dims only)
    upper_map: tuple[int, ...] = ()
    k_iters: int = 0  # pipeline stages it walks (`plan_tma` fills it in)


@dataclass(frozen=True)
class TmaPlan:
    """Everything the tma template needs beyond the shared plan values (names as in the .cu)."""

    config: TmaConfig
    precision: str
    split: bool  # 3xTF32: hi and lo planes of every operand
    elem_bytes: int
    operand_ctype: str
    wgmma_type: str  # tf32, bf16 or f16
    kstep: int  # K per wgmma: 8 (tf32) or 16 (16-bit)
    bm: int
    bn: int
    wm: int  # m64 tiles per consumer warpgroup
    stages: int
    kb_per_stage: int
    cip: int  # input channels padded (zeros)
    bkc: int  # channels per K-block (one row of the swizzled tiles)
    cb: int  # K-blocks per tap (CIP / BKC)
    kb_total: int  # K-blocks: TAPS x CB
    k_iters: int  # pipeline stages walked: the main loop's trip count
    k_total: int  # TAPS x CIP: a row of the permuted weights
    row_bytes: int  # BKC x element bytes: 32, 64 or 128
    ksteps: int  # wgmma per row (row_bytes / 32)
    swizzle_desc: int
    swizzle_tma: int
    a_bytes: int  # one K-block's A tile in shared memory (BM rows)
    b_bytes: int  # ... B tile (BN rows)
    stage_bytes: int  # shared memory of one stage (every plane)
    stage_tx: int  # bytes the TMA delivers per stage
    smem_bytes: int  # dynamic shared memory, with the alignment slack
    n_tiles: int
    cout: int
    positions: int  # M per sample
    in_positions: int  # input positions per sample
    rank: int  # the input tensor map's rank: spatial dims + 2
    lower: tuple[int, ...]  # im2col bounding box, W first
    upper: tuple[int, ...]
    elem_strides: tuple[int, ...]  # the conv's stride, W first
    prep_tc: int  # layout pass tile: channels
    prep_tp: int  # ... positions
    prep_tiles: int  # tiles per sample
    acc_regs: int  # accumulator floats per consumer thread
    # Split K (`specgen.splitk`): a second main kernel walks 1/SPLIT_K of K per block and writes its
    # sums to a workspace, `_reduce` adds them in order and runs the epilogue; 1: no such kernel.
    split_k: int = 1
    split_iters: int = 0  # stages walked per block of the split kernel (k_iters / split_k)
    channel_reduction: bool = False  # the epilogue reduces over the channels (one N tile, no split K)
    channel_norm: bool = False  # the epilogue takes a softmax or LayerNorm over the channels (one N tile, no split K)
    channel_norm_op: str = ""  # ... which one
    # The epilogue takes a statistic stage over trailing spatial dims (`row_norm`): a group is
    # `norm_rows` consecutive rows of a tile (`norm_group` positions of the output), no split K.
    row_norm: bool = False
    norm_rows: int = 0
    norm_group: int = 0
    threads: int = THREADS
    producer_regs: int = PRODUCER_REGS
    consumer_regs: int = CONSUMER_REGS
    blocks_per_sm: int = 1  # the __launch_bounds__ occupancy: 2 where registers and shared memory allow
    # A transposed conv: one GEMM per stride phase (`TmaPhase`), each phase's blocks beside the
    # others' in the grid; `k_iters` and `k_total` are then the largest phase's.
    phases: tuple[TmaPhase, ...] = ()
    grid: tuple[int, int, int] = (1, 1, 1)  # the positions each GEMM runs on (d, h, w): the output's, or every phase's
    grid_positions: int = 0  # prod(grid): M per sample of each GEMM
    n_pad: int = 0  # rows per phase of the permuted weights (N_TILES x BN: zeros past C_OUT)
    # Each block runs the two W phases of a (d, h) phase one after the other (`w_pairs`): every
    # thread then holds outputs 2j and 2j + 1 of its rows and stores them side by side.
    w_pairs: bool = False
    # The output channels innermost ([batch][d][h][w][C_OUT], channels_last), and each extra input
    # read that way: the plan for channels-last inputs (`plan.Settings.channels_last`), whose output
    # keeps the format, as PyTorch's conv does. False where the channels are reduced (one channel:
    # either layout) and for a 1-D conv (PyTorch has no such memory format).
    channels_last_out: bool = False
    # A 16-bit 1x1 conv without padding on an NC(D)HW input: its A tiles are loaded from the input
    # where it lies (`a_in_place`), no layout pass; see `reads_nchw_in_place`. Each m64 tile then lies in
    # one sample: where the positions are not whole m64 tiles, M runs over GRID_POSITIONS = the
    # positions rounded up to them per sample (`padded_rows`), and rows past the positions are
    # computed on zeros and not stored.
    a_in_place: bool = False
    # ... in tf32 and fp32 mode (`reads_nchw_staged`): the tiles land in a staging buffer at the end of
    # each stage (boxes of STAGED_BOX positions x BKC channels, 128-byte-swizzled), and warps 1-3 of
    # the producer warpgroup transpose them into the K-major A tile (fp32 mode: into its hi and lo
    # planes) before the stage's "full" barrier lets the consumers in. `stage_tx` then counts the B
    # tiles alone; the staging barrier counts the A boxes.
    a_staged: bool = False
    # ... by a conv of several taps (`reads_nchw_staged_taps`): a K-block's box of each m64 chunk is
    # STAGED_SPAN positions from its tap's shifted start rounded down to 16 bytes (unswizzled). No
    # transposers and no A tile: the consumers load wgmma's A operand from the boxes into registers,
    # each value at its shift or zero where the tap is in the padding, and `stage_tx` counts the
    # boxes with the B tiles on the one "full" barrier.
    a_shifted: bool = False
    staging_row: int = 0  # a staged stage's bytes per channel of an m64 chunk (`staging_row_bytes`), else 0
    # A strided 1x1 conv read in place: its output positions are the input's every stride-th
    # (no padding), so the launch first copies those (x[..., ::s_h, ::s_w], a quarter of the input
    # at stride 2) to a contiguous tensor, and the kernel is the stride-1 conv of that copy: no
    # layout pass over the whole input. The strides (D, H, W order, as the spec), or () at stride 1.
    subsample: tuple[int, ...] = ()
    # Why the planner's tile has 128 rows where 256 fit (`L2_WORKING_SET`), for `describe`; "" else.
    l2_note: str = ""
    # A 16-bit output: the epilogue transposes each thread's values across its group of four lanes
    # and stores four at once (`_stores_quads`): four neighbouring positions of one channel
    # (NC(D)HW), or eight neighbouring channels of one row (channels-last). A warp's stores then
    # fill whole 32-byte sectors; a value (or pair) at a time, they half-filled them.
    store_quads: bool = False
    # The main kernel's blocks each walk tiles blockIdx.x, + gridDim.x, ... (launched with as many
    # blocks as the SMs hold at once): a block's producer then loads the next tile's stages while its
    # consumers run this tile's epilogue. Not with stride phases (a block's phase comes from its
    # index) nor a softmax or reduction over the channels (whose epilogue then spilled 972 bytes).
    persistent: bool = False

    @property
    def gemms(self) -> int:
        """GEMMs: the stride phases, or the one conv."""
        return max(1, len(self.phases))

    @property
    def padded_rows(self) -> bool:
        """Whether M has rows past each sample's positions (A read in place, positions not whole m64 tiles)."""
        return self.a_in_place and self.grid_positions != self.positions

    @property
    def staging_at(self) -> int:
        """A staged stage's staging buffer offset (`_smem`): past its planes' A and B tiles."""
        return _past_planes((2 if self.split else 1) * self.kb_per_stage * (self.a_bytes + self.b_bytes))

    @property
    def grid_gemms(self) -> int:
        """What multiplies an M tile's blocks along N in the grid: the phases, or their W pairs."""
        return self.gemms // 2 if self.w_pairs else self.gemms


def _phases(spec: LayerSpec) -> tuple[TmaPhase, ...]:
    """The stride phases of a transposed conv (dilation 1, each kernel extent at least its stride),
    W phases fastest: neighbouring blocks of the grid write the two halves of the same lines."""
    geo = spec.conv_geometry()
    nd = spec.ndim
    pad3 = lambda t, fill: (fill,) * (3 - nd) + tuple(t)  # noqa: E731  (d, h, w)
    k3, s3, p3 = pad3(geo["kernel"], 1), pad3(geo["stride"], 1), pad3(geo["padding"], 0)
    in3, out3 = pad3(spec.input.size, 1), pad3(spec.conv_output().sizes[1:], 1)
    # (phi, OP, FIRST, KP, LOWER = IN_OFF - (KP - 1)) per dim: the taps reversed
    per_dim = [[(*c[:4], c[4] - (c[3] - 1)) for c in dim] for dim in igemm.phase_dims(k3, s3, p3, out3)]
    grid = tuple(max(c[1] for c in dim) for dim in per_dim)
    phases = []
    for d in per_dim[0]:
        for h in per_dim[1]:
            for w in per_dim[2]:
                kp = (d[3], h[3], w[3])
                # tap t' reads input j + LOWER + t': the conv's tap FIRST + S * (KP - 1 - t')
                taps3 = [[c[2] + s * (c[3] - 1 - t) for t in range(c[3])] for c, s in zip((d, h, w), s3)]
                index = tuple((kd * k3[1] + kh) * k3[2] + kw for kd in taps3[0] for kh in taps3[1] for kw in taps3[2])
                lower = (d[4], h[4], w[4])
                # the box spans the grid: GRID positions along each dim from LOWER
                upper = tuple(g - i + lo for g, i, lo in zip(grid, in3, lower))
                phases.append(TmaPhase(
                    index=len(phases), out_off=(d[0], h[0], w[0]), op=(d[1], h[1], w[1]), kp=kp, lower=lower,
                    taps=math.prod(kp), tap_index=index, lower_map=tuple(reversed(lower[3 - nd:])),
                    upper_map=tuple(reversed(upper[3 - nd:])),
                ))
    return tuple(phases)


def _grid(spec: LayerSpec) -> tuple[int, int, int]:
    """The grid of positions every stride phase runs on (d, h, w): the largest phase's extents."""
    geo, nd = spec.conv_geometry(), spec.ndim
    out3 = (1,) * (3 - nd) + tuple(spec.conv_output().sizes[1:])
    s3 = (1,) * (3 - nd) + tuple(geo["stride"])
    return tuple(-(-o // s) for o, s in zip(out3, s3))


def w_pairs_possible(spec: LayerSpec) -> bool:
    """Whether a transposed conv's stride phases can run as W pairs: stride 2 along W with both W
    phases present, and an epilogue that stores each value where it was computed (no reduction or
    softmax over the channels). An extra input is read at both outputs of the pair."""
    if not spec.conv.transposed or one_n_tile(spec):
        return False
    geo = spec.conv_geometry()
    return geo["stride"][-1] == 2 and spec.conv_output().sizes[-1] >= 2


def _accumulators(bm: int, bn: int, split: bool, pairs: bool) -> int:
    """Accumulator floats per consumer thread: a m64 tile's BN / 2 for each of its BM / 128 tiles,
    for each GEMM it holds at once (a W pair: two), and in 3xTF32 once more for the stage's sums."""
    return (bm // 128) * bn // 2 * ((2 if pairs else 1) + (1 if split else 0))


def _kb_unit(spec: LayerSpec, cb: int) -> tuple[int, int]:
    """(K-blocks every stage count must divide, M positions per sample of all the GEMMs): a plain
    conv's K-blocks and positions; for a transposed conv the gcd of its phases' K-blocks and the
    phases' grids."""
    if not spec.conv.transposed:
        return math.prod(spec.conv_geometry()["kernel"]) * cb, math.prod(spec.conv_output().sizes[1:])
    phases = _phases(spec)
    return math.gcd(*(ph.taps for ph in phases)) * cb, math.prod(_grid(spec)) * len(phases)


def why_not(spec: LayerSpec, levels: list, reductions: list, target: targets.Target) -> list[str]:
    """The reasons the TMA engine cannot run this layer (empty: it can)."""
    reasons = []
    if not has_tma_engine(target):
        reasons.append(f"{target.arch} has no wgmma/TMA (Hopper, sm_90)")
    if spec.conv.groups > 1:
        reasons.append("the conv has groups")
    transposed = getattr(spec.conv, "transposed", False)
    if transposed:
        geo = spec.conv_geometry()
        if any(d != 1 for d in geo["dilation"]):
            reasons.append("the transposed conv has a dilation")
        elif any(k < s for k, s in zip(geo["kernel"], geo["stride"])):
            reasons.append("a stride phase of the transposed conv meets no tap (a kernel smaller than its stride)")
    if len(levels) > 1:
        reasons.append("a pool follows the conv")
    if reductions:
        if not (len(reductions) == 1 and reductions[0]["axes"] == ["c"]):
            reasons.append("the epilogue reduces over positions (only a reduction over the channels alone runs here)")
        elif spec.conv.out_channels > MAX_REDUCED_CHANNELS:
            reasons.append(f"a reduction over more than {MAX_REDUCED_CHANNELS} channels (one block must hold them all)")
        elif spec.inputs():
            reasons.append("an extra input before a reduction over the channels")
    rows_at = row_norm(spec)
    if rows_at is not None:
        if spec.inputs():
            reasons.append("an extra input or saved value around a statistic stage over positions")
        elif row_norm_rows(spec, w_pairs_possible(spec)) is None:
            reasons.append(f"epilogue[{rows_at}] {spec.epilogue[rows_at].op}'s group of {row_norm_group(spec)} positions is not "
                           f"16 to 256 rows (a power of two) of one GEMM's tile"
                           + (" (a transposed conv: only a group over W, stride 2 along W, an even output width)"
                              if spec.conv.transposed else ""))
    norm = channel_norm(spec)
    if norm is not None:
        if spec.conv.out_channels > MAX_REDUCED_CHANNELS:
            reasons.append(f"a {spec.epilogue[norm].op} over more than {MAX_REDUCED_CHANNELS} channels (one block must hold them all)")
        if spec.inputs():
            reasons.append(f"an extra input or saved value around a {spec.epilogue[norm].op} over the channels")
    rank = spec.ndim + 2
    geo = spec.conv_geometry()
    if transposed:
        if not reasons:
            corners = [c for ph in _phases(spec) for c in (*ph.lower_map, *ph.upper_map)]
            if not all(-CORNER_LIMIT[rank] <= c < CORNER_LIMIT[rank] for c in corners):
                reasons.append(f"a stride phase's input box exceeds the TMA im2col box limits of a {spec.ndim}-D conv")
        return reasons
    for k, p, d in zip(geo["kernel"], geo["padding"], geo["dilation"]):
        lo, hi = -p, p - (k - 1) * d
        if not (-CORNER_LIMIT[rank] <= lo < CORNER_LIMIT[rank] and -CORNER_LIMIT[rank] <= hi < CORNER_LIMIT[rank]):
            reasons.append(f"the padding or kernel span exceeds the TMA im2col box limits of a {spec.ndim}-D conv")
            break
        if (k - 1) * d >= 1 << 15:
            reasons.append("the kernel span exceeds the TMA im2col offsets")
            break
    if any(s > 8 for s in geo["stride"]):
        reasons.append("a stride above 8 (the TMA traversal stride limit)")
    return reasons


NORMS_ON_CHANNELS = ("softmax", "log_softmax", "layer_norm_channels")  # statistic stages the epilogue can take over one block's channels
# A statistic stage over trailing spatial dims (`row_norm`): its group is R consecutive rows of the
# tile, whole chunks of a warp's 16 rows of an m64 tile, dividing BM; the tile's accumulators at
# most 64 floats a thread, which leaves the registers for the statistics.
ROW_NORM = True  # (off: such stages run on the tail engine, as before; benchmarks/row_norm.py's A/B)
ROW_NORM_CHUNK = 16
ROW_NORM_ROWS = (16, 32, 64, 128, 256)  # (dividing a tile of BM 128 or 256)
ROW_NORM_MAX_ACC = 64


def channel_norm(spec: LayerSpec) -> int | None:
    """The index of a softmax, log-softmax or LayerNorm over the channels alone that comes after nothing but
    pointwise stages (the epilogue can then normalize the accumulators: see the module
    docstring), or None."""
    first = next((i for i, st in enumerate(spec.epilogue) if st.kind != "pointwise"), None)
    if first is None or spec.epilogue[first].kind != "norm" or spec.epilogue[first].op not in NORMS_ON_CHANNELS:
        return None
    span = spec.norm_span(first)
    return first if (span.first, span.last) == (1, 1) else None


def row_norm(spec: LayerSpec) -> int | None:
    """The index of a statistic stage over trailing spatial dims alone (a LayerNorm over W or over
    H and W, a softmax over W, an instance norm of a small map; not across the batch) that comes
    after nothing but pointwise stages, which the epilogue can take where a tile holds whole groups
    (`row_norm_rows`); else None."""
    from specgen import ops

    first = next((i for i, st in enumerate(spec.epilogue) if st.kind != "pointwise"), None)
    if not ROW_NORM or first is None or spec.epilogue[first].kind != "norm":
        return None
    row = ops.NORMS[spec.epilogue[first].op]
    span = spec.norm_span(first)
    axes = spec.shapes()[first].axes
    if row.statistic not in ("moments", "lse") or span.across_batch or span.split != 1:
        return None
    if not axes or axes[0].role != "c" or span.first < 2 or span.last != len(axes):
        return None
    return first


def row_norm_group(spec: LayerSpec) -> int:
    """The positions one group of the `row_norm` stage holds (the product of the dims it spans)."""
    at = row_norm(spec)
    span = spec.norm_span(at)
    return math.prod(spec.shapes()[at].sizes[span.first - 1:span.last])


def row_norm_rows(spec: LayerSpec, pairs: bool) -> int | None:
    """The rows of a tile one group of the `row_norm` stage holds (None: not a power of two from 16
    to 256, which whole tiles hold, or not rows of one GEMM): a conv's group of positions; for a
    transposed conv's stride phases run as W pairs (`pairs`), a group over W alone whose two W
    phases have as many outputs each: W / 2 grid rows, each holding both phases' outputs (the
    other phases' rows are other GEMMs')."""
    at = row_norm(spec)
    if at is None:
        return None
    group = row_norm_group(spec)
    if spec.conv.transposed:
        span = spec.norm_span(at)
        width = spec.conv_output().sizes[-1]
        if not pairs or span.first != len(spec.shapes()[at].axes) or width % 2:
            return None
        group //= 2
    return group if group in ROW_NORM_ROWS else None


def row_norm_fits(spec: LayerSpec) -> bool:
    """Whether the epilogue can take the layer's `row_norm` stage: groups a tile holds whole, no extra input."""
    return row_norm(spec) is not None and not spec.inputs() and row_norm_rows(spec, w_pairs_possible(spec)) is not None


def channel_reduction(spec: LayerSpec) -> bool:
    """Whether the layer's only stage that is not pointwise (besides a `channel_norm` before it)
    reduces over the channels alone (the epilogue can then reduce the accumulators: see the module
    docstring)."""
    norm = channel_norm(spec)
    others = [i for i, st in enumerate(spec.epilogue) if st.kind != "pointwise" and i != norm]
    return len(others) == 1 and spec.epilogue[others[0]].kind == "reduce" and tuple(spec.reduce_dims(others[0])) == (1,)


def one_n_tile(spec: LayerSpec) -> bool:
    """Whether a block must hold every channel: the epilogue reduces or normalizes over them."""
    return channel_reduction(spec) or channel_norm(spec) is not None


# Below this many multiply-adds per input byte the layout pass (a full read and write of the input)
# costs more than the faster main loop saves, and the implicit-GEMM engine, which reads the input
# where it lies, wins (measured on an H200, benchmarks/NOTES.md v17: a 1x1 conv 256 -> 64 at 32, 2x
# faster on igemm; 64 -> 256 at 128, even in tf32 and 6% slower in fp32, whose pass writes two planes).
MIN_INTENSITY = {"tf32": 64, "fp32": 192}
# A stride-1 1x1 conv reads its NC(D)HW input where it lies on the implicit GEMM with whole rows of positions
# per K chunk, so the pass pays later: in tf32 only from 128 multiply-adds per input byte (a 1x1 conv
# to 256 channels). Measured on an H200 (benchmarks/NOTES.md v31, 15 ResNet and MobileNet 1x1 shapes
# at batch 64, both engines): 512 -> 128 at 28^2 0.166 ms on TMA, 0.097 on the implicit GEMM;
# 256 -> 128 at 56^2 0.264 / 0.149; 960 -> 160 at 7^2 0.107 / 0.087; 64 -> 256 at 56^2 0.160 / 0.173.
MIN_INTENSITY_POINTWISE = {"tf32": 128, "fp32": 192}
# ...except where the input is narrow and the conv widens it: fewer than 32 input channels (they do
# not fill the implicit GEMM's 32-wide K chunk, so half or more of its multiply-adds are padding
# with 16 channels) and at least 4x as many output channels (the pass moves the small input, the
# kernel writes the large output). MobileNetV2's first expansions, measured on an H200 at batch 64
# in tf32 (benchmarks/NOTES.md v33, `specgen tune`'s timing): 16 -> 96 at 112^2 0.362 ms on the
# implicit GEMM, 0.180 on TMA; 24 -> 144 at 56^2 0.146 / 0.106. (32 -> 16 at 112^2 stays: 0.066 / 0.145.)
NARROW_POINTWISE_MAX_CHANNELS = 31
NARROW_POINTWISE_MIN_WIDENING = 4


def intensity(spec: LayerSpec) -> float:
    """The conv's multiply-adds per byte of an fp32 input: C_OUT x taps x output / input positions / 2."""
    geo = spec.conv_geometry()
    taps = math.prod(geo["kernel"])
    if spec.conv.transposed:  # each output meets about taps / stride-volume of the taps
        taps /= math.prod(geo["stride"])
    ratio = math.prod(spec.conv_output().sizes[1:]) / math.prod(spec.input.size)
    return spec.conv.out_channels * taps * ratio / 2


def worth_it(spec: LayerSpec) -> bool:
    """Whether the planner, left to itself, takes the TMA engine (bf16 / fp16 always: the other
    engines have no 16-bit path)."""
    geo = spec.conv_geometry()
    pointwise = math.prod(geo["kernel"]) == 1 and math.prod(geo["stride"]) == 1 and not spec.conv.transposed
    if pointwise and spec.precision == "tf32" and spec.conv.groups == 1 and spec.input.channels <= NARROW_POINTWISE_MAX_CHANNELS \
            and spec.conv.out_channels >= NARROW_POINTWISE_MIN_WIDENING * spec.input.channels:
        return True  # a narrow input widened (`NARROW_POINTWISE_MAX_CHANNELS`)
    table = MIN_INTENSITY_POINTWISE if pointwise else MIN_INTENSITY
    return intensity(spec) >= table.get(spec.precision, 0)


# The layout pass moves tiles of 4096 values (16 KB of floats in shared memory) with 16-byte reads
# and writes: the copy engine's rate needs that many bytes in flight (tiles of 1024 values and
# element-wide accesses ran at about half the copy rate, measured on an H200).
PREP_TILE = 4096


def reads_in_place(spec: LayerSpec) -> bool:
    """Whether the engine reads a channels-last input where it lies, with no layout pass: one
    operand plane (not fp32's hi and lo) and channels that need no padding (`_channels`)."""
    eb = ELEM_BYTES[spec.precision]
    return spec.precision != "fp32" and spec.input.channels == _channels(spec.input.channels, eb)[0]


# A tile of A read from an NC(D)HW input where it lies is one TMA load per m64 tile: 64 positions of
# one sample (a 128-byte row of 16-bit values per channel) x BKC channels.
NCHW_CHUNK = 64
# tf32 / fp32 1x1 convs read their NC(D)HW input in place through a staging buffer (`reads_nchw_staged`)
# where True (the default; False: they pay the layout pass). Measured on an H100 (benchmarks/staged_nchw.py,
# NOTES v70): GPU time 1.09-1.53x the pass's on the MobileNetV2 and ResNet-50 1x1 convs it takes.
STAGED_NCHW = True
# ... where M padded per sample to whole m64 tiles adds at most this share of rows (`_staged_rows_ok`).
STAGED_MAX_PADDING = 0.125
# Staged A tiles land as boxes of 32 positions (128 bytes of fp32: the widest 128-byte-swizzled box).
STAGED_BOX = 32
# A tf32 / fp32 conv of several taps (stride 1, its output the input's extents) reads its NC(D)HW
# input in place through the staging buffer too where True (`reads_nchw_staged_taps`): the consumers
# load wgmma's A operand from the staged boxes into registers. Where its taps and input channels are
# at most these: measured on an H100 (benchmarks/staged_nchw.py --taps, NOTES v71), 1.06-1.53x faster
# than the layout pass and its conv on 3x3 convs of 64 and 128 channels at batch 8 and 64 in both
# modes, and 0.83-0.93x on a 5x5 conv in tf32 and a 256-channel 3x3 in fp32 (each position is loaded
# once per tap, and a box is 72 positions for 64 rows: 12.5% more bytes than the A tile the pass
# feeds). Such a conv takes the pass's tile (`_sized`: a taller one lost at batch 1).
STAGED_TAPS = True
STAGED_TAPS_MAX_TAPS = 9
STAGED_TAPS_MAX_CIN = 128
# Such a K-block's tap shifts its m64 chunk's 64 positions along the flattened positions; the box
# starts at the shifted start rounded down to 16 bytes (a tiled load's innermost coordinate must be)
# and spans 64 + 8 positions, unswizzled: rows 72 words apart put the four channels one register
# load of a warp reads (8 positions each) in four different groups of 8 banks.
STAGED_SPAN = NCHW_CHUNK + 8


def reads_nchw_in_place(spec: LayerSpec) -> bool:
    """Whether the engine can read an NC(D)HW input where it lies, with no layout pass: a 1x1 conv
    without padding (M is then the output's positions, and K the input channels) whose
    rows of output positions are whole 16-byte units (a tensor map's strides must be). A strided
    one reads the subsampled copy of its input the launch makes (`TmaPlan.subsample`), a stride-1
    conv over the output's positions.
    Where the positions are not whole m64 tiles the plan pads M per sample (`TmaPlan.padded_rows`)
    and has no split kernel, so it reads in place only where the planner gives it none.

    A K-block's A tile is then BKC channels x 64 positions, which land as BKC rows of 128 bytes:
    positions contiguous (MN-major), the layout wgmma reads with its A operand transposed -- which it
    allows for 16-bit types only. A tf32 operand must be K-major: in tf32 and fp32 mode the tiles
    land in a staging buffer and the producer warpgroup's three idle warps transpose them into the
    K-major tile in shared memory (`reads_nchw_staged`; fp32 mode splits each value into its two
    planes there). Measured on an H200 (benchmarks/NOTES.md v35): the bf16 1x1 conv 256 -> 64 at
    56^2 spent more time in the layout pass than in its GEMM.

    A conv of several taps cannot read NC(H)W in place this way: a tap shifts its 64 positions by
    an element or two along the row, the tiled load's innermost coordinate, and a tiled load whose
    innermost coordinate is not a whole 16 bytes faults with an illegal instruction (measured on an
    H100 by benchmarks/tma_inner_offset.cu: offsets 0 and 8 bf16 elements load, 1, 2, 3 and -1
    fault, while any offset along an outer dimension, -1 included, loads and zero-fills; NOTES v65)."""
    geo = spec.conv_geometry()
    positions = math.prod(spec.conv_output().sizes[1:])
    return (
        (ELEM_BYTES[spec.precision] == 2 or (STAGED_NCHW and _staged_rows_ok(positions)))
        and not spec.conv.transposed and spec.conv.groups == 1
        and all(k == 1 for k in geo["kernel"]) and all(p == 0 for p in geo["padding"])
        and positions * ELEM_BYTES[spec.precision] % 16 == 0
    )


def _staged_rows_ok(positions: int) -> bool:
    """Whether a staged 1x1 conv's M, padded to whole m64 tiles per sample, stays within
    STAGED_MAX_PADDING of its positions: measured on an H100 (NOTES v70), 14^2 (196 positions run as
    256 rows) lost to the layout pass at batch 64 (0.86x and 0.95x), 56^2 and 112^2 (no padding) won
    1.25-1.38x."""
    rows = -(-positions // NCHW_CHUNK) * NCHW_CHUNK
    return rows <= positions * (1 + STAGED_MAX_PADDING)


def reads_nchw_staged_taps(spec: LayerSpec) -> bool:
    """Whether a conv of several taps reads its NC(D)HW input in place through the staging buffer
    (`TmaPlan.a_shifted`): tf32 / fp32, stride 1, its output the input's extents (a "same" conv:
    then output position o reads input position o + the tap's shift along the flattened positions,
    where the tap lies inside the input), groups 1, at most STAGED_TAPS_MAX_TAPS taps and
    STAGED_TAPS_MAX_CIN input channels, and the positions whole m64 tiles per sample. (With
    M padded per sample, the plan reads in place only where it has no split kernel, which the tile
    decides; a tile sized for the stage without an A tile then no longer fits the stage with one:
    measured on an H100, 128 -> 128 at 28^2 in fp32 fell to the implicit GEMM at 0.41x.)
    The launch's tiled boxes of STAGED_SPAN positions start on 16-byte boundaries; the consumers
    read each position's value at its shift into their A registers, zero where the tap falls in the
    padding."""
    geo = spec.conv_geometry()
    return (
        STAGED_TAPS and ELEM_BYTES[spec.precision] == 4 and not spec.conv.transposed and spec.conv.groups == 1
        and 1 < math.prod(geo["kernel"]) <= STAGED_TAPS_MAX_TAPS and spec.input.channels <= STAGED_TAPS_MAX_CIN
        and all(st == 1 for st in geo["stride"])
        and tuple(spec.conv_output().sizes[1:]) == tuple(spec.input.size)
        and math.prod(spec.input.size) % NCHW_CHUNK == 0
    )


def reads_nchw_staged(spec: LayerSpec) -> bool:
    """Whether an NC(D)HW input read in place goes through a staging buffer (`TmaPlan.a_staged`):
    32-bit operands (tf32 and fp32 mode), which wgmma reads K-major only."""
    return ELEM_BYTES[spec.precision] == 4 and (reads_nchw_in_place(spec) or reads_nchw_staged_taps(spec))


def staging_row_bytes(spec: LayerSpec) -> int:
    """The staging buffer's bytes per channel of an m64 chunk: two boxes of 32 positions for a 1x1
    conv, one of STAGED_SPAN for a conv of several taps."""
    return (STAGED_SPAN if math.prod(spec.conv_geometry()["kernel"]) > 1 else NCHW_CHUNK) * 4


def has_tma_engine(target: targets.Target) -> bool:
    """Hopper: built for sm_90a, where wgmma lives (TMA exists on plain sm_90 too)."""
    return target.arch in ("sm_90", "sm_90a")


def _channels(cin: int, elem_bytes: int) -> tuple[int, int]:
    """(CIP, BKC): channels padded so a K-block row is 32, 64 or 128 bytes."""
    per32 = 32 // elem_bytes  # channels in 32 bytes: 8 fp32 or 16 bf16
    cip = -(-cin // per32) * per32
    for bkc in (4 * per32, 2 * per32, per32):
        if cip % bkc == 0:
            return cip, bkc
    raise AssertionError("unreachable: per32 divides cip")


def _align(nbytes: int, row_bytes: int) -> int:
    """`nbytes` rounded up to the swizzle pattern's repeat (8 rows)."""
    unit = 8 * row_bytes
    return -(-nbytes // unit) * unit


def _smem(cfg: TmaConfig, row_bytes: int, planes: int, staging_row: int = 0) -> tuple[int, int, int]:
    """(A tile, B tile, stage) bytes. A staged stage (`reads_nchw_staged`; `staging_row`: its bytes
    per channel of an m64 chunk, `staging_row_bytes`) ends, 1024-byte aligned, with its A tiles'
    staging buffer (fp32 values as loaded, one plane). The tap-shifted boxes (`TmaPlan.a_shifted`)
    are read from there into registers: no A tile."""
    a_bytes = 0 if _shifted(staging_row) else _align(cfg.bm * row_bytes, row_bytes)
    b_bytes = _align(cfg.bn * row_bytes, row_bytes)
    stage = planes * cfg.kb_per_stage * (a_bytes + b_bytes)
    if staging_row:
        stage = _past_planes(stage) + _staging_bytes(cfg, row_bytes, staging_row)
    return a_bytes, b_bytes, stage


def _shifted(staging_row: int) -> bool:
    """Whether a stage of staging rows of `staging_row` bytes (`staging_row_bytes`) holds tap-shifted
    boxes (`TmaPlan.a_shifted`), read into registers, rather than a 1x1 conv's transposed tiles."""
    return staging_row == STAGED_SPAN * 4


def _staging_bytes(cfg: TmaConfig, row_bytes: int, staging_row: int) -> int:
    """A stage's staging buffer: per K-block and m64 chunk, a staging row per channel (fp32)."""
    return cfg.kb_per_stage * (cfg.bm // 64) * (row_bytes // 4) * staging_row


def _sized(cfg: TmaConfig, row_bytes: int, planes: int, staging_row: int) -> int:
    """The stage bytes a tile is chosen by: its own (`_smem`), and for a conv reading its taps in
    place at least those of the stage the layout pass would feed (with an A tile), so that its tile
    and depth are the pass's wherever both fit."""
    stage = _smem(cfg, row_bytes, planes, staging_row)[2]
    return max(stage, _smem(cfg, row_bytes, planes)[2]) if _shifted(staging_row) else stage


def _past_planes(nbytes: int) -> int:
    """Where a staged stage's staging buffer starts: its planes' `nbytes`, 1024-byte aligned."""
    return -(-nbytes // SMEM_ALIGN) * SMEM_ALIGN


def _kb_options(kb_total: int, row_bytes: int) -> list[int]:
    """K-blocks per stage, best first: divisors of the K-blocks (every stage full), about 128
    bytes of K per row (32 fp32 or 64 bf16 values) first, then fewer."""
    divisors = [d for d in range(1, kb_total + 1) if kb_total % d == 0 and d * row_bytes <= 256]
    first = next((d for d in divisors if d * row_bytes >= 128), divisors[-1])
    return [first] + sorted((d for d in divisors if d < first), reverse=True)


def candidates(cout: int, m_total: int, split: bool, sm_count: int, whole_n: bool = False,
               pairs: bool = False, norm_rows: int = 0, tap_row_bytes: int = 0) -> list[tuple[int, int]]:
    """(BM, BN) shapes worth trying, best guess first: the accumulators must fit (at most 128
    floats per consumer thread, twice as many registers in 3xTF32: the stage's part and the sum);
    tiles whose input rows in flight fit L2_WORKING_SET first, then the lowest cost (waves of tiles
    over the SMs times a tile's work, TILE_COST_N / TILE_COST_M). `whole_n`: only tiles holding
    every channel (a reduction over them). `norm_rows`: only tiles of whole groups of that many
    rows, with at most ROW_NORM_MAX_ACC accumulators (a statistic stage over positions).
    `tap_row_bytes`: the bytes of one input position's channels (all planes) where several taps
    read them, else 0."""
    n_pad = -(-cout // 8) * 8
    shapes = []
    widths = {n_pad} if whole_n else {min(256, n_pad), min(128, n_pad), min(64, n_pad)}
    if norm_rows:
        widths |= {min(32, n_pad)}
    for bn in sorted(widths, reverse=True):
        for bm in (256, 128):
            if norm_rows and (bm % norm_rows or _accumulators(bm, bn, split, pairs) > ROW_NORM_MAX_ACC):
                continue
            if _accumulators(bm, bn, split, pairs) <= MAX_ACC:
                shapes.append((bm, bn))
    sms = sm_count or 132

    def cost(shape):
        bm, bn = shape
        tiles = -(-m_total // bm) * -(-cout // bn)
        waves = -(-tiles // sms)
        # a wave costs its tile's arithmetic; small tiles pay more per product (their A and B
        # loads and the wgmma's operand reads are amortized over fewer products)
        eff = 1.0 + TILE_COST_N / bn + TILE_COST_M / bm
        spills_l2 = rows_in_flight(bm, bn, cout, m_total, tap_row_bytes, sms) > L2_WORKING_SET
        return spills_l2, waves * bm * bn * eff

    return sorted(dict.fromkeys(shapes), key=cost)


def rows_in_flight(bm: int, bn: int, cout: int, m_total: int, tap_row_bytes: int, sms: int) -> int:
    """Bytes of input rows the SMs' BM x BN tiles hold at once (one tile an SM, at most the
    tiles there are): what `L2_WORKING_SET` bounds."""
    return bm * tap_row_bytes * min(-(-m_total // bm) * -(-cout // bn), sms)


def _tap_row_bytes(spec: LayerSpec, cip: int, elem_bytes: int) -> int:
    """`candidates`' `tap_row_bytes`: one input position's channels in the operand planes (two in
    fp32 mode) where several taps read it; 0 for a 1x1 conv."""
    if math.prod(spec.conv_geometry()["kernel"]) == 1:
        return 0
    return cip * elem_bytes * (2 if spec.precision == "fp32" else 1)


def _l2_note(spec: LayerSpec, cfg: TmaConfig, cip: int, elem_bytes: int, target: targets.Target,
             batch: int = 64) -> str:
    """Where `candidates` would have ranked a 256-row tile before the planner's but put it last for
    keeping more input rows in flight than L2_WORKING_SET, that, in words; else "" (the layout
    `default_config` plans for: `batch` samples)."""
    row = _tap_row_bytes(spec, cip, elem_bytes)
    if cfg.bm != 128 or not row or cfg.blocks_per_sm != 1:
        return ""
    m_total = batch * _kb_unit(spec, 1)[1]
    pairs = w_pairs_possible(spec)
    unlimited = candidates(spec.conv.out_channels, m_total, spec.precision == "fp32", target.sm_count,
                           one_n_tile(spec), pairs, _norm_rows(spec, pairs))
    if (cfg.bm, cfg.bn) not in unlimited:
        return ""
    for bm, bn in unlimited[:unlimited.index((cfg.bm, cfg.bn))]:
        in_flight = rows_in_flight(bm, bn, spec.conv.out_channels, m_total, row, target.sm_count or 132)
        if bm == 256 and in_flight > L2_WORKING_SET:
            return (f"{cfg.bm} x {cfg.bn} tiles, not {bm} x {bn}: those would keep {in_flight / 1e6:.0f} MB of "
                    f"input rows in flight across the taps (at batch {batch}), past the "
                    f"{L2_WORKING_SET / 1e6:.0f} MB kept for them in L2")
    return ""


# The planner's deepest pipeline: `specgen tune` measured 5-8 stages 4-41% slower than 4 on every
# layer of benchmarks/tma_blocks.yaml but a 3-D one (1.07 against 1.02x: NOTES v24); 512 channels
# prefer 4 too (v17).
MAX_STAGES = 4


def default_config(spec: LayerSpec, target: targets.Target, batch: int = 64, two_blocks: bool = True,
                   channels_last: bool = False) -> TmaConfig:
    """The planner's guess for `batch` samples (the grid depends on the batch; the tile is chosen
    for a typical one). Up to 64 channels outside fp32 mode: 256 x N tiles, two blocks per SM
    (`specgen tune` measured them 1.05-1.89x the former one-block 256 x N tiles of 5-8 stages on
    13 layers at batch 32 and 128, the most on shallow convs whose epilogue is most of a block's
    time, and the fastest TMA tile or within 1% of it at batch 128; 128 x N two-block tiles lost on
    light epilogues and 16 channels: NOTES v24) -- not with extra inputs, whose reads need more
    registers (a residual's add spilled 16 bytes under the cap), nor when `two_blocks` is False (the
    pipeline's retry of a build that spilled), nor where two blocks would leave each fewer than
    TWO_BLOCK_MIN_STAGES stages of a K that has more (in bf16 / fp16, 128 x N tiles are tried next:
    their stages are half as large). Otherwise the first tile shape (see `candidates`) whose stages
    of about 128 bytes of K fit 4 deep (3 in fp32 mode, whose stages hold two planes), else with
    fewer K-blocks per stage."""
    eb = ELEM_BYTES[spec.precision]
    split = spec.precision == "fp32"
    cip, bkc = _channels(spec.input.channels, eb)
    kb_total, positions = _kb_unit(spec, cip // bkc)
    row = bkc * eb
    n_pad = -(-spec.conv.out_channels // 8) * 8
    pairs = w_pairs_possible(spec)
    rows = _norm_rows(spec, pairs)
    transposed = spec.conv.transposed
    # (a channels-last plan reads its input as it lies: no staging buffer)
    staged = staging_row_bytes(spec) if reads_nchw_staged(spec) and not channels_last else 0
    # A conv reading its taps in place (`TmaPlan.a_shifted`) gets the tile the layout pass would get
    # (`_sized`): the taller one its stage without an A tile fits ran at 0.54x at batch 1 on an H100
    # (fp32 64 -> 64 at 56^2: 13 blocks of 256 x 64, NOTES v71). (Where that is two blocks per SM,
    # the plan keeps the pass: see `plan`.)
    if two_blocks and not split and not spec.inputs() and not rows:
        # (a W pair holds two GEMMs' accumulators: 128 rows)
        heights = (128,) if pairs else (256,) if transposed or spec.precision == "tf32" else (256, 128)
        min_stages = TWO_BLOCK_TRANSPOSED_MIN_STAGES if transposed else TWO_BLOCK_MIN_STAGES
        for bm in heights:
            if not two_blocks_fit(bm, n_pad, split, pairs):
                continue
            for kps in _kb_options(kb_total, row):
                stage = _sized(TmaConfig(bm, n_pad, 2, kps), row, 1, staged)
                # (no deeper than the stages walked; a stride phase's block walks at least KB_TOTAL / KPS)
                walked = kb_total // kps if not transposed else MAX_STAGES
                stages = min(MAX_STAGES, walked, _two_block_stages(target, stage))
                if stages >= max(2, min(min_stages, walked)):
                    return TmaConfig(bm, n_pad, stages, kps, blocks_per_sm=2)
    if rows and spec.conv.transposed and two_blocks and not split:
        # A transposed conv's blocks hold one tile each (its phases are not walked): two blocks per
        # SM hide one's pipeline fill and epilogue behind the other's loads and products, on a tile
        # narrow enough that the statistics fit their registers. KernelBench 34 (LayerNorm over W)
        # at batch 16 on an H100: 128 x 32 of two blocks 0.885 ms, 128 x 64 of one 1.376, 128 x 32
        # of one 1.149 (`specgen tune`, NOTES v51).
        kps = _kb_options(kb_total, row)[0]
        for bn in sorted({min(n_pad, 64), min(n_pad, 32)}, reverse=True):
            if 128 % rows or not two_blocks_fit(128, bn, split, pairs, rows):
                continue
            stage = _sized(TmaConfig(128, bn, 2, kps), row, 1, staged)
            stages = _two_block_stages(target, stage, row_norm_smem(128, bn))  # (as deep as two blocks fit, as tuned)
            if stages >= 2:
                return TmaConfig(128, bn, stages, kps, blocks_per_sm=2)
    shapes = candidates(spec.conv.out_channels, batch * positions, split, target.sm_count, one_n_tile(spec), pairs, rows,
                        _tap_row_bytes(spec, cip, eb))
    planes = 2 if split else 1
    want = 3 if split else 4
    fallback = None
    for kps in _kb_options(kb_total, row):
        for bm, bn in shapes:
            stage = _sized(TmaConfig(bm, bn, 2, kps), row, planes, staged)
            budget = target.smem_per_block - SMEM_ALIGN - (row_norm_smem(bm, bn) if rows else 0)
            stages = min(MAX_STAGES, budget // stage)
            if stages >= want:
                if _shifted(staged):  # (the pass's tile, as deep as its own stages fit)
                    stages = min(MAX_STAGES, budget // _smem(TmaConfig(bm, bn, 2, kps), row, planes, staged)[2])
                return TmaConfig(bm, bn, stages, kps)
            if stages >= 2 and fallback is None:
                fallback = TmaConfig(bm, bn, stages, kps)
    if fallback is None:
        raise ValueError(f"no TMA tile fits the {target.smem_per_block} bytes of shared memory of a block on {target.arch}")
    return fallback


def configs(spec: LayerSpec, target: targets.Target, batch: int = 64) -> list[TmaConfig]:
    """The tile shapes worth measuring (`specgen tune`), the planner's guess first: each shape of
    `candidates` with the deepest pipeline that fits (at most 8 stages) and with 4 stages."""
    eb = ELEM_BYTES[spec.precision]
    split = spec.precision == "fp32"
    cip, bkc = _channels(spec.input.channels, eb)
    kb_total, positions = _kb_unit(spec, cip // bkc)
    row = bkc * eb
    kps = _kb_options(kb_total, row)[0]
    out = [default_config(spec, target, batch)]
    planes = 2 if split else 1
    k_iters = kb_total // kps
    pairs = w_pairs_possible(spec)
    rows = _norm_rows(spec, pairs)
    staged = staging_row_bytes(spec) if reads_nchw_staged(spec) else 0
    for bm, bn in candidates(spec.conv.out_channels, batch * positions, split, target.sm_count, one_n_tile(spec), pairs, rows,
                             _tap_row_bytes(spec, cip, eb)):
        stage = _smem(TmaConfig(bm, bn, 2, kps), row, planes, staged)[2]
        deepest = min(8, (target.smem_per_block - SMEM_ALIGN - (row_norm_smem(bm, bn) if rows else 0)) // stage)
        options = [TmaConfig(bm, bn, stages, kps) for stages in sorted({deepest, min(4, deepest)}, reverse=True) if stages >= 2]
        # (two blocks of a conv that could read its taps in place keep the pass: `plan`, stages with an A tile)
        two_stage = _sized(TmaConfig(bm, bn, 2, kps), row, planes, staged)
        two_stages = min(k_iters, _two_block_stages(target, two_stage, row_norm_smem(bm, bn) if rows else 0))
        if two_blocks_fit(bm, bn, split, pairs, rows) and two_stages >= 2:
            options.append(TmaConfig(bm, bn, two_stages, kps, blocks_per_sm=2))
        out += [cfg for cfg in options if cfg not in out]
    if pairs and not rows:  # the stride phases one per block too (not where a statistic group needs both W phases)
        out += [replace(cfg, phases_per_block=1) for cfg in out[:2] if _accumulators(cfg.bm, cfg.bn, split, False) <= MAX_ACC]
    return out


def _norm_rows(spec: LayerSpec, pairs: bool) -> int:
    """The rows of a `row_norm` group in a tile (0: the layer has none the epilogue takes)."""
    return row_norm_rows(spec, pairs) or 0


def row_norm_smem(bm: int, bn: int) -> int:
    """Static shared memory of a `row_norm` epilogue: two arrays of one float per 16-row chunk and
    channel of the tile (the first statistic's sums, the second's)."""
    return 2 * (bm // ROW_NORM_CHUNK) * bn * 4


def two_blocks_fit(bm: int, bn: int, split: bool, pairs: bool = False, norm_rows: int = 0) -> bool:
    """Whether a tile's accumulators fit the registers of two blocks per SM (REGS_TWO_BLOCKS), with a
    `row_norm` epilogue's two statistics per m64 tile and column (`norm_rows` > 0) counted in."""
    stats = 2 * (bm // 128) * bn // 4 if norm_rows else 0
    return bn <= REGS_TWO_BLOCKS["max_bn"] and _accumulators(bm, bn, split, pairs) + stats <= REGS_TWO_BLOCKS["max_acc"]


def _two_block_stages(target: targets.Target, stage_bytes: int, extra: int = 0) -> int:
    """The deepest pipeline (at most 8 stages) of which two blocks fit in one SM's shared memory,
    each with `extra` bytes besides (a `row_norm` epilogue's sums)."""
    per_block = min(target.smem_per_block, target.smem_per_sm // 2 - BLOCK_RESERVED_SMEM)
    return min(8, (per_block - SMEM_ALIGN - extra) // stage_bytes)


def plan_tma(spec: LayerSpec, target: targets.Target, config: TmaConfig | None = None,
             two_blocks: bool = True, channels_last: bool = False) -> TmaPlan:
    """The TMA engine's plan for `config` (or the planner's guess, `default_config`); ValueError
    when it does not fit. `channels_last`: the plan for channels-last inputs, whose output is
    channels-last too (`TmaPlan.channels_last_out`)."""
    precision = spec.precision
    eb = ELEM_BYTES[precision]
    split = precision == "fp32"
    cfg = config or default_config(spec, target, two_blocks=two_blocks, channels_last=channels_last)
    cin, cout = spec.input.channels, spec.conv.out_channels
    cip, bkc = _channels(cin, eb)
    geo = spec.conv_geometry()
    taps = math.prod(geo["kernel"])
    cb = cip // bkc
    phases = _phases(spec) if spec.conv.transposed else ()
    if phases:  # every phase walks its own taps: the stage must divide each phase's K-blocks
        taps = max(ph.taps for ph in phases)
        for ph in phases:
            if ph.taps * cb % cfg.kb_per_stage:
                raise ValueError(f"{cfg.kb_per_stage} K-blocks per stage do not divide stride phase {ph.index}'s "
                                 f"{ph.taps * cb} K-blocks")
        phases = tuple(replace(ph, k_iters=ph.taps * cb // cfg.kb_per_stage) for ph in phases)
    kb_total = taps * cb
    if kb_total % cfg.kb_per_stage:
        raise ValueError(f"{cfg.kb_per_stage} K-blocks per stage do not divide the {kb_total} K-blocks")
    row = bkc * eb
    planes = 2 if split else 1
    conv_out = spec.conv_output().sizes[1:]
    positions = math.prod(conv_out)
    norm_at, reduces = channel_norm(spec), channel_reduction(spec)
    whole_n = reduces or norm_at is not None
    n_tiles = -(-cout // cfg.bn)
    k_iters = kb_total // cfg.kb_per_stage
    groups = _norm_rows(spec, False)  # (a stride phase's W pairs change it: a transposed conv has one kernel and no A in place)
    # split K counts the blocks an SM holds at once; a reduction or softmax over the channels has
    # none (the split kernel's parts would each hold part of K of every channel, to be added before it)
    split_parts = 1 if whole_n or phases or groups else cfg.split_k or splitk.choose(
        positions, cout, cfg.bm, n_tiles, k_iters, (target.sm_count or 132) * cfg.blocks_per_sm)
    # (a conv reading its taps in place: not with two blocks per SM, whose register cap its A registers
    # spill under -- 144 bytes in fp32 mode -- and which were measured behind the pass, NOTES v24)
    in_place = not channels_last and (reads_nchw_in_place(spec) or (reads_nchw_staged_taps(spec) and cfg.blocks_per_sm == 1)) \
        and (positions % NCHW_CHUNK == 0 or split_parts == 1) \
        and (not groups or positions % NCHW_CHUNK == 0)  # (a group must not meet padding rows)
    staged = in_place and eb == 4
    a_bytes, b_bytes, stage_bytes = _smem(cfg, row, planes, staging_row_bytes(spec) if staged else 0)
    smem = cfg.stages * stage_bytes + SMEM_ALIGN
    if smem > target.smem_per_block:
        raise ValueError(f"{smem} bytes of shared memory exceed the {target.smem_per_block} of a block on {target.arch}")
    wm = cfg.bm // 128
    pairs = bool(phases) and cfg.phases_per_block != 1 and w_pairs_possible(spec)
    if cfg.phases_per_block == 2 and not pairs:
        raise ValueError("W pairs of stride phases need a transposed conv of stride 2 along W whose epilogue "
                         "neither reduces nor normalizes over the channels nor reads an extra input")
    if pairs and cfg.phases_per_block == 0 and _accumulators(cfg.bm, cfg.bn, split, True) > MAX_ACC:
        pairs = False  # (a tile asked for without a word on pairs: one phase per block where two do not fit)
    acc = _accumulators(cfg.bm, cfg.bn, split, pairs)
    if acc > MAX_ACC:
        raise ValueError(f"{acc} accumulator registers per thread: more than {MAX_ACC}")
    two = cfg.blocks_per_sm == 2
    rows_at, norm_rows = row_norm(spec), _norm_rows(spec, pairs)
    if norm_rows:  # a statistic stage over positions: its sums after the stages (`row_norm_smem`)
        smem += row_norm_smem(cfg.bm, cfg.bn)
        if smem > target.smem_per_block:
            raise ValueError(f"{smem} bytes of shared memory (the pipeline's and the statistics') exceed the "
                             f"{target.smem_per_block} of a block on {target.arch}")
    if two and not two_blocks_fit(cfg.bm, cfg.bn, split, pairs, norm_rows):
        raise ValueError(f"a {cfg.bm} x {cfg.bn} tile ({acc} accumulators a thread) does not fit the registers of two "
                         f"blocks per SM (at most {REGS_TWO_BLOCKS['max_acc']} in wgmma of n{REGS_TWO_BLOCKS['max_bn']})")
    if two and 2 * (smem + BLOCK_RESERVED_SMEM) > target.smem_per_sm:
        raise ValueError(f"two blocks of {smem} bytes of shared memory do not fit the {target.smem_per_sm} of an SM")
    nd = spec.ndim
    rev = lambda t: tuple(reversed(t))  # noqa: E731  (W first, as the tensor map orders dims)
    lower = rev(tuple(-p for p in geo["padding"]))
    upper = rev(tuple(p - (k - 1) * d for k, p, d in zip(geo["kernel"], geo["padding"], geo["dilation"])))
    in_positions = math.prod(spec.input.size)
    grid = _grid(spec) if phases else (1,) * (3 - nd) + tuple(conv_out)
    if phases and cfg.split_k > 1:
        raise ValueError("a transposed conv's stride phases have no split kernel")
    if rows_at is not None:
        if not norm_rows:
            raise ValueError(f"epilogue[{rows_at}] {spec.epilogue[rows_at].op}: its group of {row_norm_group(spec)} positions "
                             f"is not 16 to 256 rows (a power of two) of one GEMM's tile"
                             + (" (a transposed conv's groups: W alone, run as W pairs)" if phases else ""))
        if cfg.bm % norm_rows:
            raise ValueError(f"BM {cfg.bm} does not hold whole groups of {norm_rows} rows (epilogue[{rows_at}] "
                             f"{spec.epilogue[rows_at].op})")
        if acc > ROW_NORM_MAX_ACC:
            raise ValueError(f"{acc} accumulator registers per thread: a statistic stage over positions takes at most "
                             f"{ROW_NORM_MAX_ACC}")
        if cfg.split_k > 1:
            raise ValueError("split K with a statistic stage over positions (a block must hold all of K)")
    cl_out = channels_last and nd >= 2 and not reduces  # (`TmaPlan.channels_last_out`)
    if whole_n and n_tiles > 1:
        raise ValueError(f"BN {cfg.bn} does not hold the {cout} channels the epilogue reduces or normalizes over")
    if in_place and positions % NCHW_CHUNK:  # M per sample padded to whole m64 tiles
        grid = (1, 1, -(-positions // NCHW_CHUNK) * NCHW_CHUNK)
    if whole_n and cfg.split_k > 1:
        raise ValueError("split K with a reduction or softmax over the channels")
    if k_iters % split_parts:
        raise ValueError(f"split_k {split_parts} does not divide the {k_iters} stages walked")
    prep_tc = next(c for c in (64, 32, 16, 8) if cip % c == 0)  # a power of two: the tile is PREP_TILE values
    prep_tp = PREP_TILE // prep_tc
    return TmaPlan(
        config=cfg, precision=precision, split=split, elem_bytes=eb, operand_ctype=OPERAND_CTYPE[precision],
        wgmma_type=WGMMA_TYPE[precision], kstep=32 // eb, bm=cfg.bm, bn=cfg.bn, wm=wm, stages=cfg.stages,
        kb_per_stage=cfg.kb_per_stage, cip=cip, bkc=bkc, cb=cb, kb_total=kb_total,
        k_iters=k_iters, k_total=taps * cip, row_bytes=row, ksteps=row // 32,
        swizzle_desc=SWIZZLE[row]["desc"], swizzle_tma=SWIZZLE[row]["tma"], a_bytes=a_bytes, b_bytes=b_bytes,
        stage_bytes=stage_bytes, smem_bytes=smem,
        stage_tx=planes * cfg.kb_per_stage * ((0 if staged else cfg.bm) + cfg.bn) * row
        + (_staging_bytes(cfg, row, staging_row_bytes(spec)) if staged and taps > 1 else 0),  # (its boxes)
        n_tiles=n_tiles, cout=cout, positions=positions, in_positions=in_positions, rank=nd + 2,
        lower=lower, upper=upper, elem_strides=rev(tuple(geo["stride"])), prep_tc=prep_tc, prep_tp=prep_tp,
        prep_tiles=-(-in_positions // prep_tp) * -(-cip // prep_tc), acc_regs=acc,
        split_k=split_parts, split_iters=k_iters // split_parts, channel_reduction=reduces,
        channel_norm=norm_at is not None, channel_norm_op=spec.epilogue[norm_at].op if norm_at is not None else "",
        row_norm=bool(norm_rows), norm_rows=norm_rows,
        norm_group=row_norm_group(spec) if norm_rows else 0,
        blocks_per_sm=cfg.blocks_per_sm, phases=phases, grid=grid, grid_positions=math.prod(grid),
        n_pad=n_tiles * cfg.bn, w_pairs=pairs, channels_last_out=cl_out,
        a_in_place=in_place, a_staged=staged, a_shifted=staged and taps > 1,
        staging_row=staging_row_bytes(spec) if staged else 0,
        subsample=tuple(geo["stride"]) if in_place and any(st > 1 for st in geo["stride"]) else (),
        l2_note=_l2_note(spec, cfg, cip, eb, target) if config is None else "",
        persistent=not phases and not whole_n,
        store_quads=_stores_quads(cl_out, eb, cfg.bn, cout, positions, whole_n or bool(norm_rows), bool(phases),
                                  bool(spec.inputs()) and acc >= 128),
        producer_regs=REGS_TWO_BLOCKS["producer"] if two else PRODUCER_REGS,
        consumer_regs=REGS_TWO_BLOCKS["consumer"] if two else CONSUMER_REGS,
    )


def _stores_quads(channels_last_out: bool, elem_bytes: int, bn: int, cout: int, positions: int,
                  whole_n: bool, phased: bool, tight: bool) -> bool:
    """Whether the epilogue stores four values of a lane at once (`TmaPlan.store_quads`): a 16-bit
    NC(D)HW output whose positions come in fours (four neighbouring positions of one channel, 8
    bytes), or a 16-bit channels-last one whose channels come in eights (eight neighbouring
    channels of one row, 16 bytes, from two n8 blocks: BN a multiple of 16). A float output's
    stores already fill whole sectors (eight positions, or a quad's four pairs): there the quads
    measured slower (NOTES v37). Never with stride phases or a reduction or softmax over the
    channels, nor where registers are `tight`: an extra input's reads beside 128 accumulators a
    thread (a 1x1 conv of 512 channels at 28^2 plus a residual spilled 200 bytes, against 16 one
    value at a time)."""
    if phased or whole_n or tight or elem_bytes != 2:
        return False
    if channels_last_out:
        return bn % 16 == 0 and cout % 8 == 0
    return positions % 4 == 0


def describe(tp: TmaPlan) -> str:
    mode = {"fp32": "3xTF32", "tf32": "TF32", "bf16": "bf16", "fp16": "fp16"}[tp.precision]
    walked = "/".join(str(ph.k_iters) for ph in tp.phases) if tp.phases else str(tp.k_iters)
    pairs = "; a block runs both W phases and stores their outputs side by side" if tp.w_pairs else ""
    phases = (f", one GEMM per stride phase of the transposed conv ({len(tp.phases)} phases on a "
              f"{' x '.join(map(str, tp.grid[5 - tp.rank:]))} grid, side by side in the grid of blocks{pairs})"
              if tp.phases else "")
    return (
        f"implicit GEMM on Hopper ({mode} wgmma m64n{tp.bn}k{tp.kstep}, "
        f"{'A from registers, B' if tp.a_shifted else 'both operands'} from shared memory, fed by TMA "
        f"{'tiled' if tp.a_in_place else 'im2col'} loads){phases}: block tile {tp.bm} positions x {tp.bn} channels, {walked} stages of {tp.kb_per_stage} "
        f"K-block(s) of {tp.bkc} channels, {tp.stages}-stage mbarrier pipeline, 1 producer warp + 2 consumer "
        f"warpgroups{', two blocks per SM' if tp.blocks_per_sm == 2 else ''}"
        f"{', each block walking tiles (as many blocks as the SMs hold)' if tp.persistent else ''}; "
        + (("A read from the NC(D)HW input where it lies (per tap, tiled TMA loads of "
            f"{STAGED_SPAN} positions x {tp.bkc} channels from the tap-shifted positions into a staging buffer, "
            "each consumer thread loading its A registers from there, zeros in the padding"
            f"{', split into hi and lo parts' if tp.split else ''}), no layout pass" if tp.a_shifted else
            "A read from the NC(D)HW input where it lies (tiled TMA loads of 32 positions x "
            f"{tp.bkc} channels into a staging buffer, transposed there by 3 warps of the producer warpgroup"
            f"{', split into hi and lo planes' if tp.split else ''}), no layout pass" if tp.a_staged else
            "A read from the NC(D)HW input where it lies (tiled TMA loads of 64 positions x "
            f"{tp.bkc} channels, positions contiguous: wgmma's A operand transposed), no layout pass")
           + (f" (the stride-{'x'.join(map(str, tp.subsample))} positions copied out first, a stride-1 conv of the copy)"
              if tp.subsample else "")
           + (f"; M padded to {tp.grid_positions} rows per sample (whole m64 tiles), the rows past the "
              f"{tp.positions} positions not stored" if tp.padded_rows else "")
           if tp.a_in_place else f"a layout pass lays the input out channels-last ({tp.cip} channels)")
        + ("; the output channels-last, as the input" if tp.channels_last_out else "")
        + (f"; stores of {'eight channels of a row' if tp.channels_last_out else 'four positions of a channel'} "
           "at once (transposed across four lanes)" if tp.store_quads else "")
        + (f"; for small batches K split {tp.split_k} ways ({tp.split_iters} stages a block), "
           f"the parts added in order by a second kernel" if tp.split_k > 1 else "")
        + (f"; the {'softmax' if tp.channel_norm_op == 'softmax' else tp.channel_norm_op} over the channels taken on "
           "the accumulators (shuffles among the 4 lanes of a row)" if tp.channel_norm else "")
        + (f"; the statistic stage over positions taken on the accumulators (groups of {tp.norm_group} positions, "
           f"{tp.norm_rows} rows of the tile: shuffles within a warp, sums in shared memory across warps)"
           if tp.row_norm else "")
        + ("; the reduction over the channels taken on the accumulators (shuffles among the 4 lanes of a row)"
           if tp.channel_reduction else "")
        + (f"; {tp.l2_note}" if tp.l2_note else "")
    )
