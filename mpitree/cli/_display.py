"""Terminal output shared by the subcommands: a progress bar and honest overhead cells."""

import sys

NOISE = "~0 (noise)"
NOISE_NOTE = (
    f"{NOISE}: timed at or below local attention alone, so the overhead is within timing noise"
)


def progress(title, done, total, label):
    """Draw a one-line progress bar on stderr; end the line once ``done == total``.

    Call it on one rank only (rank 0), between timed regions.
    """
    width = 30
    filled = int(width * done / total)
    sys.stderr.write(
        f"\r{title} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<28}"
    )
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def overhead(ms):
    """Format an overhead in ms; one at or below zero is within noise, never shown negative."""
    return f"+{ms:.2f}" if ms > 0 else NOISE
