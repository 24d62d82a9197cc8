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


def _host_source(text: str, planes: int) -> str:
    """The prelude, the kernel's constants, its tf32_round (fp32 mode) and transpose, and the harness."""
    head = text[:text.index("struct alignas(64) TensorMap")]
    consts = [line for line in head.splitlines() if re.match(r"(constexpr (int|unsigned) |static_assert\()", line)]
    start = text.index("// ---- the staged A tiles' transpose")
    body = text[start:text.index("}  // namespace", start)]
    # the shared-memory accesses are the prelude's (the kernel's are PTX)
    body = re.sub(r"__device__ __forceinline__ float4 lds_v4\(.*?\n}\n", "", body, flags=re.S)
    body = re.sub(r"__device__ __forceinline__ void sts_v4\(.*?\n}\n", "", body, flags=re.S)
    body = re.sub(r"__device__ __forceinline__ float lds_f32\(.*?\n}\n", "", body, flags=re.S)
    assert "asm" not in body
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


_GATHER_MAIN = r"""
// x.bin: one sample's BKC channels x IN_POSITIONS floats; m0: the tile's first row; off_d, off_h, off_w:
// the tap's offsets. Stages each chunk's box as the TMA lands it (from the shifted start rounded down
// to 16 bytes, zeros past the positions), gathers every unit and writes the A tile back.
int main(int argc, char** argv) {  // x.bin tile.bin trace.txt m0 off_d off_h off_w
  std::vector<float> x(BKC * IN_POSITIONS);
  FILE* f = std::fopen(argv[1], "rb");
  if (std::fread(x.data(), sizeof(float), x.size(), f) != x.size()) return 1;
  std::fclose(f);
  trace = std::fopen(argv[3], "w");
  const int m0 = std::atoi(argv[4]), off_d = std::atoi(argv[5]), off_h = std::atoi(argv[6]), off_w = std::atoi(argv[7]);
  const unsigned staged = STAGING_AT, tile = 0;
  std::memset(smem, 0xFF, sizeof smem);
  int chunk_p[A_CHUNKS];
  for (int q = 0; q < A_CHUNKS; ++q) {
    chunk_p[q] = (m0 + 64 * q) % M_PER;
    const int shift = off_d * (IN_H * IN_W) + off_h * IN_W + off_w;
    const int first = (chunk_p[q] + shift) & ~3;
    for (int c = 0; c < BKC; ++c)
      for (int t = 0; t < SPAN; ++t) {
        const int g = first + t;
        const float v = g >= 0 && g < IN_POSITIONS ? x[c * IN_POSITIONS + g] : 0.0f;
        std::memcpy(smem + staged + q * A_CHUNK_BYTES + (c * SPAN + t) * 4, &v, 4);
      }
  }
  for (int u = 0; u < TRANSPOSE_UNITS; ++u) {
    unit_now = u;
    gather_unit(staged, tile, u, chunk_p, off_d, off_h, off_w);
  }
  std::fclose(trace);
  write_tile(argv[2], tile);
  return 0;
}
"""

@pytest.mark.parametrize("precision,cin,size,kernel,padding,dilation", [
    ("tf32", 16, (12, 20), 3, 1, 1),  # 240 positions: M padded to 256 per sample
    ("tf32", 32, (16, 16), 5, 2, 1),
    ("fp32", 40, (16, 12), 3, 2, 2),  # dilated; 40 channels: the K-block's last 24 past C_IN
    ("tf32", 16, (4, 6, 8), 3, 1, 1),  # 3-D
    ("fp32", 24, (200,), 7, 3, 1),  # 1-D, M padded
])
def test_the_gather_takes_each_taps_shifted_values_and_zeros_in_the_padding(monkeypatch, tmp_path, precision, cin,
                                                                            size, kernel, padding, dilation):
    """A conv of several taps read in place (`TmaPlan.a_shifted`): for every tap and a few tiles, the
    A tile holds at row m, channel k the input's value at output position m shifted by the tap, or
    zero where the tap falls in the padding -- what the im2col load gives the other path."""
    monkeypatch.setattr(tma, "STAGED_TAPS", True)
    spec = validate({"name": "shifted", "input": {"channels": cin, "size": list(size)},
                     "conv": {"out_channels": 64, "kernel": kernel, "padding": padding, "dilation": dilation},
                     "epilogue": ["relu"], "precision": precision, "tile": {"engine": "tma"}})
    plan = build_plan(spec, target=HOPPER)
    tp = plan["tma"]
    assert tp.a_in_place and tp.a_staged and tp.a_shifted
    planes = 2 if tp.split else 1
    text = render_plan(plan)
    m_per = tp.grid_positions if tp.padded_rows else tp.positions
    source = tmp_path / "gather.cpp"
    harness = _host_source(text, planes).replace(_MAIN, "")
    source.write_text(harness + f"\nconstexpr int M_PER = {m_per};\n" + _GATHER_MAIN)
    binary = tmp_path / "gather"
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
            offs = (0,) * (3 - nd) + tuple(t * dilation - padding for t in tap)
            subprocess.run([str(binary), str(tmp_path / "x.bin"), str(tmp_path / "tile.bin"), str(tmp_path / "trace.txt"),
                            str(m0), *map(str, offs)], check=True)
            got = torch.frombuffer(bytearray((tmp_path / "tile.bin").read_bytes()), dtype=torch.float32)
            got = got.view(planes, tp.bm, tp.bkc)
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
            if tp.split:
                assert torch.equal(got[0][rows] + got[1][rows], want[rows]), (m0, tap)
                assert torch.equal(got[0][rows], _tf32(want[rows])), (m0, tap)
            else:
                assert torch.equal(got[0][rows], want[rows]), (m0, tap)
    # the 32 lanes of a warp (32 consecutive units) load consecutive words of one row (the last tap's
    # trace; a unit whose tap is in the padding loads nothing)
    trace = [tuple(map(int, line.split())) for line in (tmp_path / "trace.txt").read_text().splitlines()]
    loads = {}
    for unit, store, address in trace:
        if not store:
            loads.setdefault(unit, []).append(address)
    assert loads
    for first in range(0, tp.bm * tp.bkc // 4, 32):
        for e in range(4):
            assert len({loads[u][e] // 4 - u for u in range(first, first + 32) if u in loads}) <= 1, (first, e)
