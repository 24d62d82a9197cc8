"""A conv that reads its input nearest-upsampled (`conv: {upsample: 2}`), computed as the
transposed conv it equals: the upsampled tensor is never made, and each output meets only the taps
that fall on distinct input values.

Along one dim, with scale s, a stride-1 conv of kernel K and padding p over the upsampled input u
(u[t] = x[floor(t / s)]) gives at output o = s * i + a (phase a in [0, s)):

    y[s i + a] = sum_k w[k] u[s i + a + k - p] = sum_k w[k] x[i + floor((a + k - p) / s)]
               = sum_d W_a[d] x[i + d],   W_a[d] = sum of the w[k] with floor((a + k - p) / s) = d.

A transposed conv of stride s, kernel K', padding P' gives y[o] = sum_i' x[i'] W'[o + P' - s i'],
that is y[s i + a] = sum_d W'[a + P' - s d] x[i + d]. So W'[a + P' - s d] = W_a[d] for every
phase a and offset d; P' is chosen so that the smallest such index is 0, K' spans to the largest.
Its output has (H - 1) s - 2 P' + K' + output_padding values; the conv's has s H + 2 p - K + 1,
which fixes output_padding. Where the padding exceeds kernel - 1 (outputs that no tap reaches)
there is no such transposed conv, and the spec is refused. A 3 x 3 conv (padding 1) at scale 2 becomes a 4 x 4 transposed conv of
stride 2, padding 1: 4 taps per output where the conv over the upsampled tensor spends 9. The
weights: W'[j] = sum_k M[j][k] w[k] per dim (M of 0s and 1s, `Derived.taps`), its two channel
axes swapped per group (transposed weights lie [C_in, C_out / groups, k...]), combined at launch in
double (`specgen.torchop.upsample_weight`)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_SCALE = 8  # upsampling factors a spec may ask for (each phase is a GEMM of its own)


@dataclass(frozen=True)
class Derived:
    """One dim of the transposed conv a conv over an upsampled input equals."""

    kernel: int
    padding: int
    output_padding: int
    taps: tuple  # taps[j] = the conv taps k whose weights sum into the transposed tap j


def derive(kernel: int, padding: int, scale: int) -> Derived | None:
    """The transposed conv (stride `scale`) that a stride-1, dilation-1 conv of `kernel` and
    `padding` over an input upsampled `scale` times equals along one dim, or None where its output
    padding would fall outside [0, scale)."""
    cells: dict[tuple[int, int], list[int]] = {}  # (phase a, offset d) -> the conv taps k
    for a in range(scale):
        for k in range(kernel):
            cells.setdefault((a, (a + k - padding) // scale), []).append(k)
    d_max = max(d for _, d in cells)
    index = {(a, d): a + scale * (d_max - d) for a, d in cells}  # a + P' - s d with P' = s * d_max
    lo, hi = min(index.values()), max(index.values())
    pad = scale * d_max - lo
    size = hi - lo + 1
    # (H - 1) s - 2 P' + K' + op = s H + 2 p - K + 1
    output_padding = scale + 2 * padding - kernel + 1 + 2 * pad - size
    if pad < 0 or not 0 <= output_padding < scale:
        return None
    taps: list[list[int]] = [[] for _ in range(size)]
    for cell, ks in cells.items():
        taps[index[cell] - lo].extend(ks)
    return Derived(size, pad, output_padding, tuple(tuple(sorted(t)) for t in taps))


def dims(kernel, padding, scale) -> list[Derived | None]:
    """`derive` for each spatial dim."""
    return [derive(k, p, s) for k, p, s in zip(kernel, padding, scale)]


def _derived(spec) -> tuple[dict, list[Derived]]:
    """(the spec's conv geometry, each dim's Derived): the spec has been validated, so each exists."""
    g = spec.conv_geometry()
    return g, dims(g["kernel"], g["padding"], g["upsample"])


def equivalent(spec):
    """The transposed-conv spec a spec with `conv.upsample` computes as (same epilogue and tile)."""
    from specgen.spec import LayerSpec

    g, found = _derived(spec)
    data = spec.model_dump(mode="json")
    data["conv"].update(transposed=True, upsample=1, stride=list(g["upsample"]), kernel=[d.kernel for d in found],
                        padding=[d.padding for d in found], output_padding=[d.output_padding for d in found])
    return LayerSpec.model_validate(data)


def transform(spec) -> dict:
    """The plan's weight transform (specgen.torchop.upsample_weight)."""
    g, found = _derived(spec)
    return {"kind": "upsample_fold", "groups": spec.conv.groups, "kernel": list(g["kernel"]),
            "taps": [[list(t) for t in d.taps] for d in found]}


def note(spec) -> str:
    g, found = _derived(spec)
    x = "x".join
    return (f"upsample fold: the conv over the input upsampled {x(map(str, g['upsample']))} (nearest) is the "
            f"transposed conv of kernel {x(str(d.kernel) for d in found)}, stride {x(map(str, g['upsample']))}, "
            f"padding {x(str(d.padding) for d in found)}, output padding {x(str(d.output_padding) for d in found)} "
            f"(its weights the conv taps each phase meets, summed at launch in double): the upsampled input is never made")
