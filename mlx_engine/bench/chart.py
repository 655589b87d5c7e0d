"""A dependency-free PNG bar chart (numpy + zlib): speedup over mlx-lm plain decoding per mode."""

import struct
import zlib

import numpy as np

# 5x7 bitmap glyphs for the characters the labels use
_FONT = {
    " ": "00000000000000000000000000000000000", ".": "00000000000000000000000000000001100",
    "-": "00000000000000011111000000000000000", "=": "00000000001111100000111110000000000",
    "x": "00000000001000101010001000101010001", ":": "00000011000110000000001100011000000",
    "(": "00010001000100001000010000010000010", ")": "01000001000001000010000100010001000",
    "/": "00001000010001000100010001000010000", "_": "00000000000000000000000000000011111",
}
_GLYPHS = {
    "0": "0111010001100111010111001100010111001110", "1": "00100011000010000100001000010001110",
    "2": "01110100010000100010001000100011111", "3": "11111000100010000010000011000101110",
    "4": "00010001100101010010111110001000010", "5": "11111100001111000001000011000101110",
    "6": "00110010001000011110100011000101110", "7": "11111000010001000100010000100001000",
    "8": "01110100011000101110100011000101110", "9": "01110100011000101111000010001001100",
}
_LETTERS = {
    "a": "00000000000111000001011111000101111", "b": "10000100001011011001100011000111110",
    "c": "00000000000111010000100001000101110", "d": "00001000010110110011100011000101111",
    "e": "00000000000111010001111111000001110", "f": "00110010010100011100010000100001000",
    "g": "00000011111000110001011110000101110", "h": "10000100001011011001100011000110001",
    "i": "00100000000110000100001000010001110", "j": "00010000000011000010000101001001100",
    "k": "10000100001001010100110001010010010", "l": "01100001000010000100001000010001110",
    "m": "00000000001101010101101011000110001", "n": "00000000001011011001100011000110001",
    "o": "00000000000111010001100011000101110", "p": "00000000001111010001111101000010000",
    "q": "00000000000110110011011110000100001", "r": "00000000001011011001100001000010000",
    "s": "00000000000111010000011100000111110", "t": "01000010001110001000010000100100110",
    "u": "00000000001000110001100011001101101", "v": "00000000001000110001100010101000100",
    "w": "00000000001000110001101011010101010", "y": "00000000001000110001011110000101110",
    "z": "00000000001111100010001000100011111",
}
_FONT.update({k: v[:35] for k, v in _GLYPHS.items()})
_FONT.update(_LETTERS)


def _text(img, x, y, s, color, scale=2):
    for ch in s.lower():
        bits = _FONT.get(ch, _FONT[" "])
        glyph = np.array([int(b) for b in bits], dtype=bool).reshape(7, 5)
        glyph = glyph.repeat(scale, 0).repeat(scale, 1)
        h, w = glyph.shape
        if y + h <= img.shape[0] and x + w <= img.shape[1]:
            img[y : y + h, x : x + w][glyph] = color
        x += 6 * scale


def _png(img: np.ndarray) -> bytes:
    h, w, _ = img.shape
    raw = b"".join(b"\x00" + img[r].tobytes() for r in range(h))

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) + \
        chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


COLORS = [(70, 130, 180), (230, 140, 60)]


def speedup_chart(path, modes: list[str], series: dict[str, list[float]], title: str) -> None:
    """Horizontal bars: one row per mode, one bar per series (e.g. temperature), a line at 1.0x."""
    row, bar, left, right, top = 34, 12, 330, 60, 50
    vmax = max([1.0] + [v for vals in series.values() for v in vals if v == v]) * 1.1
    width, height = left + 420 + right, top + row * len(modes) + 40
    img = np.full((height, width, 3), 255, dtype=np.uint8)
    scale_x = 420 / vmax
    _text(img, 10, 10, title, (0, 0, 0))
    for j, name in enumerate(series):
        _text(img, left + 200 * j, 30, f"= {name}", COLORS[j % 2], 1)
        img[30:37, left + 200 * j - 10 : left + 200 * j - 3] = COLORS[j % 2]
    for i, mode in enumerate(modes):
        y = top + i * row
        _text(img, 8, y + 6, mode[:26], (40, 40, 40))
        for j, (name, vals) in enumerate(series.items()):
            v = vals[i]
            if v != v:  # nan: not run
                continue
            y0 = y + j * (bar + 2)
            img[y0 : y0 + bar, left : left + max(1, int(v * scale_x))] = COLORS[j % 2]
            _text(img, left + int(v * scale_x) + 4, y0 + 2, f"{v:.2f}x", (0, 0, 0), 1)
    one = left + int(scale_x)
    img[top - 5 : height - 30, one : one + 1] = (200, 0, 0)
    _text(img, one - 12, height - 24, "1.0x", (200, 0, 0), 1)
    with open(path, "wb") as f:
        f.write(_png(img))
