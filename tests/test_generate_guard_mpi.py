"""mtt.generate runs user code on each rank (a streamer, a tokenizer): a failure raises everywhere.

The streamer's ``put``/``end`` and the tokenizer's ``decode`` (stop strings) run on
each rank outside the model's collectives. Each step's outcome (a failure, every
row's end) is settled in one flagged collective, so a failure on one rank raises
on every rank, and ranks whose tokenizers end rows differently raise instead of
hanging or returning different sequences; they get copies of the tokens, so what
they write into them changes nothing. After each failure, a correct call with
a streamer on rank 0 only and stop strings streams and returns the right tokens.
"""

import mpitree.adapters.transformers as mtt
import pytest
import torch
from helpers import world
from models import prompt, tiny_llama

import mpitree

NEW = 8


def bad_rank():
    return world().size - 1


class Streamer:
    """Records what it is given; raises on the bad rank at the ``fail``-th put, or at end."""

    def __init__(self, fail=None):
        self.fail, self.puts, self.ended = fail, [], False

    def put(self, ids):
        self.puts.append(ids.tolist())
        if self.fail == len(self.puts):
            raise RuntimeError(f"the streamer broke at put {len(self.puts)}")

    def end(self):
        if self.fail == "end":
            raise RuntimeError("the streamer broke at end")
        self.ended = True


class Digits:
    """A tokenizer stand-in: token t decodes to "<t+shift>"; raises at the ``fail``-th decode."""

    def __init__(self, shift=0, fail=None):
        self.shift, self.fail, self.calls = shift, fail, 0

    def decode(self, ids):
        self.calls += 1
        if self.calls == self.fail:
            raise RuntimeError("the tokenizer broke")
        return "".join(f"<{int(t) + self.shift}>" for t in ids)


class Scribbler:
    """A streamer and tokenizer stand-in that overwrites every tensor it was ever given."""

    def __init__(self):
        self.seen = []

    def scribble(self, ids):
        self.seen.append(ids)
        for held in self.seen:
            held.fill_(5)

    def put(self, ids):
        self.scribble(ids)

    def end(self):
        self.scribble(torch.zeros(1, dtype=torch.long))

    def decode(self, ids):
        text = "".join(f"<{int(t)}>" for t in ids)
        self.scribble(ids)
        return text


def model():
    m = tiny_llama()
    m.set_attn_implementation("mpitree")
    return m


def generate(m, **kw):
    ids, _ = prompt(9, False)
    cache = mtt.ShardedCache(m.config, block_size=4)
    return mtt.generate(m, ids, cache, drafter=mtt.PromptLookup(), max_new_tokens=NEW, **kw)


def raises_everywhere(call, message):
    """``call()`` raises on every rank: the bad rank its own error, the others RankError."""
    with pytest.raises(Exception) as info:
        call()
    err = info.value
    if world().rank == bad_rank():
        assert isinstance(err, RuntimeError) and str(err) == message, repr(err)
    else:
        assert isinstance(err, mpitree.RankError), repr(err)
        assert err.rank == bad_rank() and err.reason == f"RuntimeError: {message}"


def streams_exactly(m):
    """A streamer on rank 0 only and stop strings: the plain tokens, cut and padded, streamed."""
    ids, _ = prompt(9, False)
    free = generate(m, eos_token_id=[]).sequences[:, ids.shape[1] :]
    stop = f"<{int(free[0, 2])}>"  # row 0 ends at its third token at the latest
    streamer = Streamer() if world().rank == 0 else None
    out = generate(
        m, eos_token_id=[], pad_token_id=0, stop_strings=stop, tokenizer=Digits(), streamer=streamer
    ).sequences[:, ids.shape[1] :]
    ends = [next((j + 1 for j in range(NEW) if f"<{int(row[j])}>" == stop), NEW) for row in free]
    assert out.shape[1] == max(ends)
    for row, end in enumerate(ends):
        assert torch.equal(out[row, :end], free[row, :end])
        assert bool((out[row, end:] == 0).all())
    if streamer is not None:
        streamed = [t for put in streamer.puts[1:] for t in put]
        assert streamer.puts[0] == ids[0].tolist() and streamed == free[0, : ends[0]].tolist()
        assert streamer.ended


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("fail", [3, "end"])
@pytest.mark.parametrize("others", ["streamer", "none"])
def test_a_streamer_that_raises_on_one_rank_raises_on_every_rank(fail, others):
    m = model()
    mine = bad_rank() == world().rank
    streamer = Streamer(fail if mine else None) if mine or others == "streamer" else None
    message = "the streamer broke at " + ("end" if fail == "end" else f"put {fail}")
    raises_everywhere(lambda: generate(m, eos_token_id=[], streamer=streamer), message)
    streams_exactly(m)


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_a_tokenizer_that_raises_on_one_rank_raises_on_every_rank():
    m = model()
    tokenizer = Digits(fail=3 if world().rank == bad_rank() else None)
    stop = dict(eos_token_id=[], stop_strings="<never>", tokenizer=tokenizer)
    raises_everywhere(lambda: generate(m, **stop), "the tokenizer broke")
    streams_exactly(m)


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize("rows", ["one row", "every row"])
def test_tokenizers_that_decode_differently_raise_on_every_rank(rows):
    """Row ends that differ between ranks: one rank would leave the loop early, or pad alone."""
    m = model()
    ids, _ = prompt(9, False)
    free = generate(m, eos_token_id=[]).sequences[:, ids.shape[1] :]
    stop = [f"<{int(free[0, 1])}>"] + ([f"<{int(free[1, 1])}>"] if rows == "every row" else [])
    shift = NEW * 1000 if world().rank == bad_rank() else 0  # no stop string ever matches there
    tokenizer = Digits(shift=shift)
    with pytest.raises(ValueError, match="ranks disagree on row ends") as info:
        generate(m, eos_token_id=[], stop_strings=stop, tokenizer=tokenizer)
    assert info.match("tokenizers decode the same tokens differently")
    streams_exactly(m)


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("new", [2, NEW])
@pytest.mark.parametrize("role", ["streamer", "tokenizer"])
def test_user_code_that_overwrites_its_tokens_changes_nothing(role, new):
    """A streamer or tokenizer on one rank writes into every tensor it got: no effect.

    With views of the tokens, that rank fed its scribble to the next plain step (no
    collective compares the tokens there: a silent wrong answer at ``new=2``) or its
    returned sequences, or disagreed on the next draft (``ValueError``).
    """
    m = model()
    ids, _ = prompt(9, False)
    given = ids.clone()

    def run(**kw):
        cache = mtt.ShardedCache(m.config, block_size=4)
        drafter = mtt.PromptLookup()
        out = mtt.generate(m, ids, cache, drafter=drafter, max_new_tokens=new, **kw)
        return out.sequences

    free = run(eos_token_id=[])
    scribbler = Scribbler() if world().rank == bad_rank() else None
    if role == "streamer":
        out = run(eos_token_id=[], streamer=scribbler)
    else:
        out = run(eos_token_id=[], stop_strings="<never>", tokenizer=scribbler or Digits())
    assert torch.equal(out, free) and torch.equal(ids, given)
    assert scribbler is None or len(scribbler.seen) >= new


@pytest.mark.parallel(nprocs=[1, 2])
@pytest.mark.parametrize("stop", ["", [""], [1]])
def test_bad_stop_strings_raise_a_clear_error_on_every_rank(stop):
    """An empty stop string without a tokenizer, or a stop string that is no str."""
    m = model()
    if stop == [1]:
        with pytest.raises(TypeError, match="a str or a list of str"):
            generate(m, eos_token_id=[], stop_strings=stop, tokenizer=Digits())
    else:
        with pytest.raises(ValueError, match="needs the tokenizer"):
            generate(m, eos_token_id=[], stop_strings=stop)


class _Unprintable(RuntimeError):
    """An exception whose message cannot be formatted."""

    def __str__(self):
        raise ValueError("no str")


class UnprintableStreamer(Streamer):
    """Raises an exception whose ``str()`` raises at its second put."""

    def put(self, ids):
        super().put(ids)
        if len(self.puts) == 2:
            raise _Unprintable()


@pytest.mark.parallel(nprocs=[2, 3])
def test_an_exception_that_cannot_be_printed_still_reaches_every_rank():
    """The failing rank must reach the failure's all-gather even if str() of its error raises."""
    m = model()
    streamer = UnprintableStreamer() if world().rank == bad_rank() else None
    with pytest.raises(Exception) as info:
        generate(m, eos_token_id=[], streamer=streamer)
    if world().rank == bad_rank():
        assert type(info.value) is _Unprintable
    else:
        assert isinstance(info.value, mpitree.RankError), repr(info.value)
        assert info.value.rank == bad_rank()
        assert info.value.reason == "_Unprintable (its message could not be formatted)"
    streams_exactly(m)
