"""Install hints for optional frameworks (mpitree is installed from a checkout, not an index)."""

CPU_TORCH = "pip install torch --index-url https://download.pytorch.org/whl/cpu"

HINTS = {
    "torch": (
        f"PyTorch: pip install torch  (CPU-only machines: {CPU_TORCH}, about 200 MB instead "
        "of several GB)"
    ),
    "transformers": (
        "PyTorch and Hugging Face transformers: pip install -e '.[transformers]' from the "
        f"checkout  (CPU-only machines: {CPU_TORCH} first, or pip pulls a CUDA build of "
        "several GB)"
    ),
    "cupy": "CuPy: pip install -e '.[cupy]' from the checkout (needs a CUDA 12 GPU)",
    "flash_attn": "flash-attn: pip install -e '.[flash-attn]' from the checkout (needs a CUDA GPU)",
    "jax": "JAX: pip install -e '.[jax]' from the checkout (CPU jaxlib)",
    "triton": (
        "Triton: pip install -e '.[triton]' from the checkout (CPU tensors run under its "
        "interpreter, TRITON_INTERPRET=1)"
    ),
}


def missing(module, what, exc):
    """Return an ImportError for adapter ``module`` that names what to install."""
    return ImportError(f"{module} needs {HINTS[what]}; importing it failed: {exc}")
