"""``python -m mpitree generate`` as a user runs it: chat, batch, stdin, stop strings, JSON, errors.

The model runs (``realmodel``: SmolLM2-135M-Instruct) launch the command under
mpiexec and compare its token ids with one process's greedy decode, computed
here (transformers, sdpa, its own cache) from the same conversation. The error
cases fail before the weights load, so they launch without the model.
"""

import json
import sys
import time

import pytest
import torch
from launch import run
from mpi4py import MPI

mtt = pytest.importorskip("mpitree.adapters.transformers")
from test_real_model_mpi import reference, smollm2  # noqa: E402  (after the skip)

from mpitree.cli import build_parser  # noqa: E402

GENERATE = [sys.executable, "-m", "mpitree", "generate"]
# main() on every rank, then each rank reports the exit code it is about to return
EXIT_PER_RANK = (
    "import sys; from mpi4py import MPI; from mpitree.cli import main; rc = main(sys.argv[1:]); "
    "print(f'rank {MPI.COMM_WORLD.rank} exits {rc}', flush=True); sys.exit(rc)"
)
TURNS = ("What is MPI?", "Give one example.", "Thanks!")
OPEN_MPI = "open mpi" in MPI.Get_library_version().lower()


def conversation_ids(tokenizer, texts, system=None):
    """The ``(1, S)`` chat-template ids of a conversation (user first), the answer's turn opened."""
    head = [] if system is None else [{"role": "system", "content": system}]
    turns = [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(texts)]
    ids = tokenizer.apply_chat_template(
        head + turns, add_generation_prompt=True, return_tensors="pt"
    )
    return ids if isinstance(ids, torch.Tensor) else ids["input_ids"]


def greedy_new(ids, new):
    """One process's greedy answer to ``ids`` (its new token ids, a list)."""
    model, _ = smollm2()
    return reference(model, ids, torch.ones_like(ids), new)[0, ids.shape[1] :].tolist()


def json_lines(text):
    """The JSON objects of the lines of ``text`` that hold one."""
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@pytest.mark.realmodel
def test_chat_without_a_turn_says_so():
    """A chat whose stdin holds no turn (an empty first line) says so, and exits 0."""
    res = run(1, [*GENERATE, "--chat", "--max-new-tokens", "4"], input="\n", timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "--chat: no turn read from stdin" in res.stderr, res.stderr
    assert "tokens/s" not in res.stdout, res.stdout  # nothing was decoded


@pytest.mark.realmodel
@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_chat_keeps_the_cache_and_equals_one_process_turn_by_turn(nprocs):
    """Three turns: each turn's ids are one process's greedy decode of the whole conversation."""
    _, tokenizer = smollm2()
    res = run(
        nprocs,
        [*GENERATE, "--chat", "--json", "--max-new-tokens", "8"],
        input="\n".join(TURNS) + "\n\n",  # an empty line ends the chat (Open MPI: no EOF)
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    records = json_lines(res.stdout)
    assert [r["turn"] for r in records] == [1, 2, 3], res.stdout
    texts, held = [], 0
    for turn, record in zip(TURNS, records, strict=True):
        texts.append(turn)
        ids = conversation_ids(tokenizer, texts)
        assert record["prompt_tokens"] == ids.shape[1]
        assert record["token_ids"] == greedy_new(ids, 8), (turn, record)
        assert record["text"] == tokenizer.decode(record["token_ids"], skip_special_tokens=True)
        # the cache was kept: only the new turn's tokens ran
        assert record["reused_tokens"] == held
        held = record["cache_tokens"]
        assert held == record["prompt_tokens"] + record["new_tokens"] - 1
        assert sum(r["tokens"] for r in record["cache"]) == held
        assert len(record["cache"]) == nprocs
        assert record["time_to_first_token_s"] > 0 and record["decode_tokens_per_s"] > 0
        texts.append(record["text"])
    assert records[1]["reused_tokens"] > records[0]["prompt_tokens"]


@pytest.mark.realmodel
@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_a_batch_of_prompts_equals_one_process_per_prompt(tmp_path, nprocs):
    """--prompts/--output: answers in input order, each one process's greedy decode."""
    _, tokenizer = smollm2()
    requests = [
        {"prompt": "What is MPI?", "id": "mpi"},
        {"prompt": "Name a color.", "max_new_tokens": 3},
        {"prompt": "", "id": 7},  # an empty user message, decoded as given
        {"prompt": "What is two plus two?", "system": "Answer with one number."},
    ]
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in requests) + "\n\n")
    cmd = [*GENERATE, "--prompts", str(path), "--output", str(out), "--max-new-tokens", "6"]
    res = run(nprocs, cmd, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    answers = json_lines(out.read_text())
    assert [a["id"] for a in answers] == ["mpi", 1, 7, 3]
    for request, answer in zip(requests, answers, strict=True):
        ids = conversation_ids(tokenizer, [request["prompt"]], request.get("system"))
        assert answer["prompt_tokens"] == ids.shape[1]
        assert answer["token_ids"] == greedy_new(ids, request.get("max_new_tokens", 6)), answer
    total = sum(a["new_tokens"] for a in answers)
    assert f"4 prompts, {total} tokens generated in" in res.stdout
    assert res.stdout.count("[mpi] prompt") == 1


@pytest.mark.realmodel
@pytest.mark.parametrize("nprocs", [1, 3])
def test_stdin_prompt_system_and_stop_strings(nprocs, tmp_path):
    """--prompt-file - (stdin), --system, --stop twice, --check: the text ends before the stop."""
    _, tokenizer = smollm2()
    system, question = "You answer briefly.", "What is the capital of France?"
    ids = conversation_ids(tokenizer, [question], system)
    want = greedy_new(ids, 16)
    words = tokenizer.decode(want, skip_special_tokens=True).split()
    stop = f" {words[2]}"  # the answer's third word ends it
    source = "-"
    if OPEN_MPI:  # its mpiexec never passes rank 0 the end of stdin: the prompt from a file
        source = tmp_path / "question.txt"
        source.write_text(question)
    cmd = [*GENERATE, "--prompt-file", str(source), "--system", system, "--max-new-tokens", "16"]
    cmd += ["--stop", "never seen", "--stop", stop, "--check"]
    res = run(nprocs, cmd, input=question, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    answer = res.stdout.split("\nmpitree generate:")[0]
    assert answer.rstrip("\n") == " ".join(words[:2])
    assert f"prompt {ids.shape[1]} tokens" in res.stdout and "(stop)" in res.stdout
    assert "PASS: token ids identical" in res.stdout


@pytest.mark.realmodel
def test_json_of_an_empty_prompt_on_one_rank():
    """--prompt '' is an empty user message, decoded as given; --json prints one object."""
    _, tokenizer = smollm2()
    res = run(1, [*GENERATE, "--prompt", "", "--json", "--max-new-tokens", "4"], timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    record = json.loads(res.stdout)  # stdout is that one object
    ids = conversation_ids(tokenizer, [""])
    assert record["prompt_tokens"] == ids.shape[1]
    assert record["token_ids"] == greedy_new(ids, 4)
    assert record["text"] == tokenizer.decode(record["token_ids"], skip_special_tokens=True)
    ((cache),) = record["cache"]
    assert cache["rank"] == 0 and cache["tokens"] == record["cache_tokens"] == ids.shape[1] + 3
    assert cache["bytes"] > 0
    assert "note:" not in res.stderr  # one rank: none is empty


def failing(nprocs, args, input=None):
    """Run ``generate args`` expecting an early error; return rank 0's stderr (checked)."""
    start = time.perf_counter()
    res = run(nprocs, [sys.executable, "-c", EXIT_PER_RANK, "generate", *args], input=input)
    if "unrecognized arguments" in res.stderr:  # argparse exits (SystemExit) on every rank
        assert res.returncode == 2 and "exits" not in res.stdout, res.stdout + res.stderr
    else:
        for rank in range(nprocs):
            assert f"rank {rank} exits 2" in res.stdout, res.stdout + res.stderr
    assert "Loading weights" not in res.stderr  # before the weights load
    assert time.perf_counter() - start < 60
    assert res.stderr.count("error:") == 1, res.stderr  # once, from rank 0
    assert res.stderr.startswith("usage: python -m mpitree generate"), res.stderr
    return res.stderr


@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_bad_input_fails_once_before_the_weights_load(tmp_path, nprocs):
    empty, bad = tmp_path / "empty.txt", tmp_path / "bad.jsonl"
    empty.write_text(" \n")
    bad.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    missing = tmp_path / "missing.txt"
    cases = {
        ("--prompt-file", str(missing)): f"cannot read the prompt file {missing}",
        ("--prompt-file", str(empty), "--raw"): f"the prompt file {empty} is empty",
        ("--prompt", "", "--raw"): "--prompt '' with --raw has no token to start from",
        ("--temperature", "1e-310"): "1/1e-310 overflows float32",
        ("--stop", ""): "--stop takes a non-empty string",
        ("--prompts", str(bad), "--output", str(tmp_path / "o")): f"{bad} line 2: expected",
        ("--chat", "--prompt-file", "-"): "--chat reads its turns from stdin",
        ("--bogus",): "error: unrecognized arguments: --bogus",
    }
    if not OPEN_MPI:  # Open MPI's mpiexec never passes rank 0 the end of stdin: it would wait
        cases[("--prompt-file", "-")] = "the prompt file stdin is empty"
    # each rank count runs a third of the cases (all of them run over the three counts)
    for args, message in list(cases.items())[nprocs - 1 :: 3]:
        assert message in failing(nprocs, args, input=""), args


def test_help_tells_the_truth():
    generate = build_parser().commands["generate"]
    text = " ".join(generate.format_help().split())
    assert "greedy decoding of" not in text
    assert text.count("(default: 0.0)") == 1 and "0: greedy) (default" not in text
    for option in ("--stop", "--chat", "--system", "--json", "--prompts", "--output"):
        assert option in text
    assert "one prompt at a time" in text  # the batch says how it runs


class Letters:
    """A tokenizer stand-in: token ``i`` is the character ``chr(i)``."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def test_the_stream_never_prints_a_stop_string(capsys):
    """Text that could begin a stop string is held back; the stop string is never printed."""
    from mpitree.cli._generate_session import Stream

    for text, stops, shown in [
        ("Hello world\nand more", [" wor"], "Hello"),
        ("Hello\nwor", ["world"], "Hello\nwor"),  # "wor" held back until the end
        ("ab\n\ncd", ["\n\n"], "ab"),
        ("plain text", [], "plain text"),
    ]:
        stream = Stream(Letters(), stops, sys.stdout)
        stream.put(torch.tensor([[1, 2]]))  # the prompt: not printed
        printed = []
        for ch in text:
            stream.put(torch.tensor([ord(ch)]))
            printed.append(capsys.readouterr().out)
            assert not any(s in "".join(printed) for s in stops), (text, printed)
        stream.end()
        out = "".join(printed) + capsys.readouterr().out
        final = shown if stops and any(s in text for s in stops) else text
        assert out == final + "\n", (text, out)
        assert stream.first is not None
