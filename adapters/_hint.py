"""Install hints for optional frameworks (mpitree is installed from a checkout, not an index)."""

HINTS = {
    "torch": (
        "PyTorch: pip install torch  (CPU-only machines: pip install torch "
        "--index-url https://download.pytorch.org/whl/cpu, about 200 MB instead of several GB)"
    ),
    "transformers": "Hugging Face transformers: pip install -e '.[transformers]' from the checkout",
    "cupy": "CuPy: pip install -e '.[cupy]' from the checkout (needs a CUDA 12 GPU)",
    "flash_attn": "flash-attn: pip install -e '.[flash-attn]' from the checkout (needs a CUDA GPU)",
}


def missing(module, what, exc):
    """Return an ImportError for adapter ``module`` that names what to install."""
    return ImportError(f"{module} needs {HINTS[what]}; importing it failed: {exc}")
