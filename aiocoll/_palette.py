"""The one palette of aiocoll's pictures: the coordinator's web page (server/_page.py) and
`aiocoll bench --plot` (cli/_bench_plot.py) both take their colours from here.

Imports nothing at all, so that the coordinator (which may import only aiocoll foundations) and
the bench's plotting can both use it at no cost. The colours are Okabe and Ito's set for colour
vision deficiencies (distinct under protanopia, deuteranopia and tritanopia); the ones used for
lines and text are dark enough to read on white paper and stay apart in greyscale, where the
plot's markers and the page's words ("lost", "held back") carry the meaning as well. Yellow is
too light for text or lines on white, so it only tints backgrounds.
"""

from __future__ import annotations

__all__ = [
    "BLACK",
    "BLUE",
    "GREEN",
    "GREY",
    "ORANGE",
    "PURPLE",
    "ROLES",
    "SERIES",
    "SKY_BLUE",
    "VERMILLION",
    "YELLOW",
    "css_variables",
]

# Okabe & Ito (2008), "Color Universal Design".
BLACK = "#000000"
ORANGE = "#E69F00"
SKY_BLUE = "#56B4E9"
GREEN = "#009E73"  # bluish green
YELLOW = "#F0E442"
BLUE = "#0072B2"
VERMILLION = "#D55E00"
PURPLE = "#CC79A7"  # reddish purple
GREY = "#5F5F5F"  # not Okabe-Ito: secondary text, 6.4:1 on white

# One line per implementation in `aiocoll bench --plot` (greyscale: dark, light, middle).
SERIES: dict[str, str] = {"aiocoll": BLUE, "gloo": ORANGE, "mpi": GREEN}

# What each colour means on the coordinator's page; the CSS reads them as var(--NAME).
ROLES: dict[str, str] = {
    "ink": "#1A1A1A",  # body text
    "muted": GREY,  # labels, ages, secondary text
    "rule": "#D0D0D0",  # table rules and borders
    "paper": "#FFFFFF",
    "alive": GREEN,
    "slow": ORANGE,
    "lost": VERMILLION,  # lost members, refused joins, mismatches, the rank holding a job back
    "left": GREY,
    "waiting": BLUE,
    "link": BLUE,
    "accent": PURPLE,
    "tint-bad": "#FBE3D6",  # background of a held-back row: vermillion at 15 % on white
    "tint-note": "#FBF8D2",  # background of notices: yellow at 20 % on white
}


def css_variables() -> str:
    """ROLES as a CSS rule of custom properties (``:root { --alive: #009E73; ... }``)."""
    body = "".join(f"  --{name}: {colour};\n" for name, colour in ROLES.items())
    return ":root {\n" + body + "}\n"
