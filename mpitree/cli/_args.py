"""Argument types the subcommands share: counts and lists of counts, refused by argparse."""

import argparse


def count(minimum):
    """Return an argparse type: an int of at least ``minimum``."""

    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def counts(minimum):
    """Return an argparse type: comma-separated ints of at least ``minimum`` (a tuple)."""
    one = count(minimum)

    def parse(text):
        values = tuple(one(part.strip()) for part in text.split(",") if part.strip())
        if not values:
            raise argparse.ArgumentTypeError(f"no value in {text!r}")
        return values

    parse.__name__ = f"comma-separated integers >= {minimum}"
    return parse


def names(choices):
    """Return an argparse type: comma-separated names from ``choices`` (a tuple, in order)."""

    def parse(text):
        values = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
        unknown = [v for v in values if v not in choices]
        if unknown or not values:
            what = f"unknown {unknown}" if unknown else "none given"
            raise argparse.ArgumentTypeError(f"{what}; choose from {list(choices)}")
        return values

    parse.__name__ = "comma-separated names"
    return parse
