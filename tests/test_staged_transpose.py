"""The staged A tiles' transpose (`TmaPlan.a_staged`), run on the host: the generated kernel's own
`transpose_unit` (and the constants it reads) compiled by the host's C++ compiler, its shared-memory
loads and stores pointed at a byte array. The staging buffer is filled the way the tensor memory
accelerator lands a tiled box of 32 positions x BKC channels with the 128-byte swizzle; after every
unit of a K-block has run, the A tile must hold each (position, channel) value where wgmma reads
the K-major tile (rows of positions, ROW_BYTES of channels, swizzled in ROW_BYTES-byte mode), in
fp32 mode split into its TF32 part and the remainder -- and with 8 channel groups, the 8 lanes that
share a wavefront must touch 8 different 16-byte places of their 128-byte spans on both sides.

The swizzle is CuTe's Swizzle<3,4,3> (and <2,4,3>, <1,4,3> for 64- and 32-byte rows) on byte
addresses, as the TMA writes and wgmma reads it; a GPU run checks it against the hardware
(tests/test_tma_in_place_gpu.py)."""

from __future__ import annotations

import itertools
import math
import re
import shutil
import subprocess

import pytest
import torch

from specgen import tma
from specgen.plan import build_plan
from specgen.render import render_plan
from specgen.spec import validate
from specgen.target import BUILTIN

HOPPER = BUILTIN["sm_90"]

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs a host C++ compiler (g++)")

_PRELUDE = r"""
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#define __device__
#define __forceinline__ inline
struct float4 { float x, y, z, w; };
static unsigned char smem[1 << 20];
static int unit_now;
static FILE* trace;  // one line per access: unit, 0 = load / 1 = store, address
static float4 lds_v4(unsigned a) {
  float4 v;
  std::memcpy(&v, smem + a, 16);
  std::fprintf(trace, "%d 0 %u\n", unit_now, a);
  return v;
}
static void sts_v4(unsigned a, float x, float y, float z, float w) {
  const float v[4] = {x, y, z, w};
  std::memcpy(smem + a, v, 16);
  std::fprintf(trace, "%d 1 %u\n", unit_now, a);
}
static float lds_f32(unsigned a) {
  float v;
  std::memcpy(&v, smem + a, 4);
  std::fprintf(trace, "%d 0 %u\n", unit_now, a);
  return v;
}
static float as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static unsigned as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
#define __uint_as_float as_float
#define __float_as_uint as_uint
"""

_TILE_IO = r"""
// The byte a swizzled tile keeps the value of unswizzled address a at (CuTe's Swizzle<B, 4, 3>).
static unsigned place(unsigned a, unsigned mask) { return a ^ ((a >> 3) & mask); }

// The A tile (and its lo plane) written to `path` in [plane][position][channel] order, as wgmma reads it.
static void write_tile(const char* path, unsigned tile) {
  const unsigned mask = ROW_BYTES == 128 ? 0x70 : ROW_BYTES == 64 ? 0x30 : 0x10;
  FILE* f = std::fopen(path, "wb");
  for (int plane = 0; plane < PLANES; ++plane)
    for (int p = 0; p < BM; ++p)
      for (int c = 0; c < BKC; ++c)
        std::fwrite(smem + place(tile + plane * PLANE_BYTES + p * ROW_BYTES + 4 * c, mask), 4, 1, f);
  std::fclose(f);
}
"""

_MAIN = r"""

int main(int argc, char** argv) {  // x.bin (BM x BKC floats, [position][channel]) tile.bin trace.txt
  std::vector<float> x(BM * BKC);
  FILE* f = std::fopen(argv[1], "rb");
  if (std::fread(x.data(), sizeof(float), x.size(), f) != x.size()) return 1;
  std::fclose(f);
  trace = std::fopen(argv[3], "w");
  const unsigned staged = STAGING_AT, tile = 0;
  std::memset(smem, 0xFF, sizeof smem);  // NaN everywhere: what no unit writes stays NaN
  // the TMA's boxes: box b holds positions 32 b .. 32 b + 31, one 128-byte row per channel
  for (int p = 0; p < BM; ++p)
    for (int c = 0; c < BKC; ++c)
      std::memcpy(smem + place(staged + (p / 32) * A_BOX_BYTES + c * 128 + 4 * (p % 32), 0x70), &x[p * BKC + c], 4);
  for (int u = 0; u < TRANSPOSE_UNITS; ++u) {
    unit_now = u;
    transpose_unit(staged, tile, u);
  }
  std::fclose(trace);
  write_tile(argv[2], tile);
  return 0;
}
"""


def _kernel_part(text: str, section: str) -> tuple[list[str], str]:
    """The kernel's constants and its helpers from the comment line `section` to the end of its
    namespace, for the host: their shared-memory accesses are the prelude's (the kernel's are PTX)."""
    head = text[:text.index("struct alignas(64) TensorMap")]
    consts = [line for line in head.splitlines() if re.match(r"(constexpr (int|unsigned) |static_assert\()", line)]
    start = text.index(section)
    body = text[start:text.index("}  // namespace", start)]
    body = re.sub(r"__device__ __forceinline__ (float4 lds_v4|void sts_v4|float lds_f32)\(.*?\n}\n", "", body, flags=re.S)
    assert "asm" not in body
    return consts, body


def _host_source(text: str, planes: int) -> str:
    """The prelude, the kernel's constants, its tf32_round (fp32 mode) and transpose, and the harness."""
    consts, body = _kernel_part(text, "// ---- the staged A tiles' transpose")
    rounding = [line for line in text.splitlines() if "float tf32_round(float x)" in line]
    return "\n".join([_PRELUDE, *consts, f"constexpr int PLANES = {planes};", *rounding, body, _TILE_IO, _MAIN])


def _tf32(x: torch.Tensor) -> torch.Tensor:
    """Rounded to TF32 as the kernel's tf32_round does (to nearest, ties away from zero)."""
    bits = x.view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


@pytest.mark.parametrize("precision,cin,cout,size", [
    ("tf32", 256, 64, (56, 56)),  # BKC 32: 128-byte rows, the diagonal lanes
    ("tf32", 48, 96, (16, 16)),  # BKC 16: 64-byte rows
    ("tf32", 24, 144, (56, 56)),  # BKC 8: 32-byte rows
    ("fp32", 256, 64, (56, 56)),  # hi and lo planes
    ("fp32", 16, 96, (112, 112)),
])
def test_the_transpose_puts_every_value_where_wgmma_reads_it(monkeypatch, tmp_path, precision, cin, cout, size):
    monkeypatch.setattr(tma, "STAGED_NCHW", True)
    spec = validate({"name": "staged", "input": {"channels": cin, "size": list(size)},
                     "conv": {"out_channels": cout, "kernel": 1}, "epilogue": ["relu"], "precision": precision,
                     "tile": {"engine": "tma"}})
    plan = build_plan(spec, target=HOPPER)
    tp = plan["tma"]
    assert tp.a_staged
    planes = 2 if tp.split else 1
    source = tmp_path / "transpose.cpp"
    source.write_text(_host_source(render_plan(plan), planes))
    binary = tmp_path / "transpose"
    subprocess.run(["g++", "-std=c++17", "-O1", "-Wno-unknown-pragmas", "-x", "c++", str(source), "-o", str(binary)],
                   check=True, capture_output=True)
    torch.manual_seed(cin + tp.bkc)
    x = torch.randn(tp.bm, tp.bkc) * torch.logspace(-3, 3, tp.bkc)  # [position][channel]
    (tmp_path / "x.bin").write_bytes(x.numpy().tobytes())
    subprocess.run([str(binary), str(tmp_path / "x.bin"), str(tmp_path / "tile.bin"), str(tmp_path / "trace.txt")],
                   check=True)
    got = torch.frombuffer(bytearray((tmp_path / "tile.bin").read_bytes()), dtype=torch.float32).view(planes, tp.bm, tp.bkc)
    if tp.split:
        assert torch.equal(got[0], _tf32(x)), "the hi plane: each value's TF32 part"
        assert torch.equal(got[1], x - _tf32(x)), "the lo plane: the remainder"
        assert torch.equal(got[0] + got[1], x)
    else:  # (tf32 mode: the copy engine rounded the values as it staged them)
        assert torch.equal(got[0], x)
    # every unit reads 4 channel rows and writes 4 position rows (in each plane), 16 bytes each
    trace = [tuple(map(int, line.split())) for line in (tmp_path / "trace.txt").read_text().splitlines()]
    units = (tp.bm // 32) * 8 * (tp.bkc // 4)
    assert len(trace) == units * (4 + 4 * planes)
    if tp.bkc == 32:  # the 8 lanes of a wavefront (8 consecutive units): 8 different 16-byte places, each access
        by_unit = {}
        for unit, store, address in trace:
            by_unit.setdefault(unit, []).append((store, address))
        for first in range(0, units, 8):
            for k in range(4 + 4 * planes):
                places = {by_unit[u][k][1] // 16 % 8 for u in range(first, first + 8)}
                assert len(places) == 8, f"units {first}..{first + 7}, access {k}: a bank conflict"


_FRAGMENTS_MAIN = r"""
// x.bin: one sample's BKC channels x IN_POSITIONS floats; m0: the tile's first row; kd, kh, kw: the tap.
// Stages each chunk's box as the TMA lands it (from the shifted start rounded down to 16 bytes, zeros
// past the positions), has every thread of every m64 tile read its A registers, and writes the A tile
// they hold back, [row][channel], as wgmma's register fragment places them.
int main(int argc, char** argv) {  // x.bin tile.bin trace.txt m0 kd kh kw
  std::vector<float> x(BKC * IN_POSITIONS);
  FILE* f = std::fopen(argv[1], "rb");
  if (std::fread(x.data(), sizeof(float), x.size(), f) != x.size()) return 1;
  std::fclose(f);
  trace = std::fopen(argv[3], "w");
  const int m0 = std::atoi(argv[4]), kd = std::atoi(argv[5]), kh = std::atoi(argv[6]), kw = std::atoi(argv[7]);
  const unsigned staged = 0;
  std::memset(smem, 0xFF, sizeof smem);
  std::vector<float> tile(BM * BKC, -1.0f);
  for (int q = 0; q < A_CHUNKS; ++q) {
    const int p = (m0 + 64 * q) % M_PER, first = (p + tap_shift(kd, kh, kw)) & ~3;
    for (int c = 0; c < BKC; ++c)
      for (int t = 0; t < SPAN; ++t) {
        const int g = first + t;
        const float v = g >= 0 && g < IN_POSITIONS ? x[c * IN_POSITIONS + g] : 0.0f;
        std::memcpy(smem + staged + q * A_CHUNK_BYTES + (c * SPAN + t) * 4, &v, 4);
      }
    for (int warp = 0; warp < 4; ++warp)
      for (int lane = 0; lane < 32; ++lane) {
        unit_now = (q * 4 + warp) * 32 + lane;
        float a[KSTEPS][4];
        a_fragments(a, staged + q * A_CHUNK_BYTES, tile_rows(p, a_row(warp, lane)), a_word(warp, lane), kd, kh, kw);
        const int r = 64 * q + 16 * warp + lane / 4, tq = lane % 4;
        for (int k = 0; k < KSTEPS; ++k)
          for (int e = 0; e < 4; ++e) tile[(r + 8 * (e % 2)) * BKC + 8 * k + tq + 4 * (e / 2)] = a[k][e];
      }
  }
  std::fclose(trace);
  f = std::fopen(argv[2], "wb");
  std::fwrite(tile.data(), sizeof(float), tile.size(), f);
  std::fclose(f);
  return 0;
}
"""


def _fragments_source(text: str) -> str:
    """The prelude, the kernel's constants and its A-register helpers (`a_fragments`), and the harness."""
    consts, body = _kernel_part(text, "// ---- the consumers' A registers")
    return "\n".join([_PRELUDE, *consts, body, _FRAGMENTS_MAIN])


@pytest.mark.parametrize("precision,cin,size,kernel,padding,dilation", [
    ("tf32", 16, (16, 20), 3, 1, 1),  # rows of 20: an m64 tile starts mid-row
    ("tf32", 32, (16, 16), 5, 2, 1),
    ("fp32", 40, (16, 12), 3, 2, 2),  # dilated; 40 channels: the K-block's last 24 past C_IN
    ("tf32", 16, (4, 8, 8), 3, 1, 1),  # 3-D
    ("fp32", 24, (192,), 7, 3, 1),  # 1-D
    ("tf32", 128, (32, 32), 3, 1, 1),  # BKC 32: four k-steps
])
def test_the_a_registers_take_each_taps_shifted_values_and_zeros_in_the_padding(monkeypatch, tmp_path, precision, cin,
                                                                               size, kernel, padding, dilation):
    """A conv of several taps read in place (`TmaPlan.a_shifted`): for every tap and a few tiles, the
    A registers of the consumers' threads hold, as wgmma's register fragment places them, at row m and
    channel k the input's value at output position m shifted by the tap, or zero where the tap falls
    in the padding -- what the im2col load gives the other path. A warp's every load reads 32
    different banks."""
    monkeypatch.setattr(tma, "STAGED_TAPS_MAX_TAPS", 27)  # (the 5x5 and 3-D convs: off by default)
    spec = validate({"name": "shifted", "input": {"channels": cin, "size": list(size)},  # (128 out: one block per SM)
                     "conv": {"out_channels": 128, "kernel": kernel, "padding": padding, "dilation": dilation},
                     "epilogue": ["relu"], "precision": precision, "tile": {"engine": "tma"}})
    plan = build_plan(spec, target=HOPPER)
    tp = plan["tma"]
    assert tp.a_in_place and tp.a_staged and tp.a_shifted
    text = render_plan(plan)
    m_per = tp.grid_positions if tp.padded_rows else tp.positions
    source = tmp_path / "fragments.cpp"
    source.write_text(_fragments_source(text).replace("int main(", f"constexpr int M_PER = {m_per};\nint main(", 1))
    binary = tmp_path / "fragments"
    subprocess.run(["g++", "-std=c++17", "-O1", "-Wno-unknown-pragmas", "-x", "c++", str(source), "-o", str(binary)],
                   check=True, capture_output=True)
    torch.manual_seed(cin + kernel)
    positions = math.prod(size)
    x = torch.randn(tp.bkc, *size)  # one sample's first K-block of channels (zeros past C_IN, as the map loads)
    x[cin:] = 0.0
    (tmp_path / "x.bin").write_bytes(x.numpy().tobytes())
    nd = len(size)
    sizes3 = (1,) * (3 - nd) + tuple(size)
    tiles = sorted({0, tp.bm, (m_per - 1) // tp.bm * tp.bm})  # (the first, the second and the sample's last tile)
    taps = list(itertools.product(*(range(kernel) for _ in range(nd))))
    for m0 in tiles:
        for tap in taps:
            tap3 = (0,) * (3 - nd) + tuple(tap)
            offs = (0,) * (3 - nd) + tuple(t * dilation - padding for t in tap)
            subprocess.run([str(binary), str(tmp_path / "x.bin"), str(tmp_path / "tile.bin"), str(tmp_path / "trace.txt"),
                            str(m0), *map(str, tap3)], check=True)
            got = torch.frombuffer(bytearray((tmp_path / "tile.bin").read_bytes()), dtype=torch.float32)
            got = got.view(tp.bm, tp.bkc)
            want = torch.zeros(tp.bm, tp.bkc)
            flat = x.reshape(tp.bkc, positions)
            for r in range(tp.bm):
                o = (m0 + r) % m_per
                if o >= positions:
                    continue  # a padding row: never stored
                coords = (o // (sizes3[1] * sizes3[2]), o // sizes3[2] % sizes3[1], o % sizes3[2])
                src = [c + d for c, d in zip(coords, offs)]
                if all(0 <= s < n for s, n in zip(src, sizes3)):
                    want[r] = flat[:, (src[0] * sizes3[1] + src[1]) * sizes3[2] + src[2]]
            rows = [r for r in range(tp.bm) if (m0 + r) % m_per < positions]
            assert torch.equal(got[rows], want[rows]), (m0, tap)
    # the 32 lanes of a warp: each of their loads (same index) reads 32 different banks (the last tap's trace)
    trace = [tuple(map(int, line.split())) for line in (tmp_path / "trace.txt").read_text().splitlines()]
    loads = {}
    for thread, _, address in trace:
        loads.setdefault(thread, []).append(address)
    assert len(loads) == tp.bm // 64 * 128 and all(len(v) == 4 * tp.ksteps for v in loads.values())
    for warp in range(0, len(loads), 32):
        for n in range(4 * tp.ksteps):
            assert len({loads[warp + lane][n] // 4 % 32 for lane in range(32)}) == 32, (warp, n)


@pytest.mark.nvcc
def test_the_register_fragment_probe_builds_for_hopper(tmp_path):
    """benchmarks/wgmma_rs_fragment.cu, the GPU check of the fragment `a_fragments` fills (run on an
    H100: 0 mismatches, NOTES v71), still assembles: wgmma with a tf32 A operand from registers."""
    from pathlib import Path

    from specgen import compile as compile_mod

    probe = Path(__file__).resolve().parent.parent / "benchmarks" / "wgmma_rs_fragment.cu"
    subprocess.run([compile_mod.find_nvcc(), "-gencode", "arch=compute_90a,code=sm_90a", "-cubin", str(probe),
                    "-o", str(tmp_path / "probe.cubin")], check=True, capture_output=True)
    assert (tmp_path / "probe.cubin").stat().st_size > 0
