"""Print values: numbers as C literals, exactly (what the kernel computes with is what the spec
said), and user input quoted in messages, bounded (an error never echoes a megabyte back)."""

from __future__ import annotations

import math
import reprlib
import struct

FLOAT32_MAX = 3.4028234663852886e38
# Magnitudes from here up round to infinity in float32: FLOAT32_MAX plus half its ulp (2^104),
# where the tie goes to the even neighbour, 2^128.
_FLOAT32_OVERFLOW = 2.0**128 - 2.0**103

QUOTE_LIMIT = 200  # characters of user input an error message quotes


def to_float32(value: float) -> float:
    """The float32 nearest `value` (round to nearest even), as a Python float; +-inf past the range."""
    value = float(value)
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:  # struct refuses what rounds to +-FLOAT32_MAX or to infinity
        magnitude = FLOAT32_MAX if abs(value) < _FLOAT32_OVERFLOW else math.inf
        return math.copysign(magnitude, value)


_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = _repr.maxlong = QUOTE_LIMIT
_repr.maxlevel = 3


def quote(value, limit: int = QUOTE_LIMIT) -> str:
    """repr(value) for an error message, at most about `limit` characters, whatever came in
    (a huge or deeply nested input is elided with '...')."""
    try:
        text = _repr.repr(value)
    except Exception:  # a value whose repr fails: say what it was
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
        # A literal past FLOAT32_MAX (3.4028235e+38 for FLOAT32_MAX itself) still rounds to it,
        # but compilers may call it out of range: take a digit more instead.
        if to_float32(float(text)) == target and abs(float(text)) <= FLOAT32_MAX:
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
