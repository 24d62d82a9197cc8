"""Print numbers as C literals, exactly: what the kernel computes with is what the spec said."""

from __future__ import annotations

import math
import struct

FLOAT32_MAX = 3.4028234663852886e38


def to_float32(value: float) -> float:
    """The float32 nearest `value` (round to nearest even), as a Python float."""
    return struct.unpack("<f", struct.pack("<f", float(value)))[0]


def c_float(value: float) -> str:
    """Shortest decimal literal that parses to the same float32 as `value`, e.g. 0.2 -> '0.2f'.

    The kernel computes in float32, so the constant it sees is float32(value); the literal is
    chosen so that nvcc parses it back to exactly that float32. Infinities and NaN are refused:
    specs validate constants as finite before they get here.
    """
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"cannot print non-finite constant {value!r} as a C literal")
    if abs(value) > FLOAT32_MAX:
        raise ValueError(f"constant {value!r} overflows float32")
    target = to_float32(value)
    for digits in range(1, 18):
        text = f"{target:.{digits}g}"
        if to_float32(float(text)) == target:
            break
    if "e" not in text and "." not in text:
        text += ".0"
    elif "e" in text and "." not in text.split("e")[0]:
        mantissa, exponent = text.split("e")
        text = f"{mantissa}.0e{exponent}"
    return text + "f"


def c_int(value: int) -> str:
    if type(value) is not int:
        raise TypeError(f"expected an int, got {value!r}")
    return str(value)
