"""The retrieval probes put their needles and answers where they say, score them right (a
perfect copier scores 100%, its window-only twin chance beyond the window), and the
loss-by-distance masks match a brute-force definition."""

from __future__ import annotations

import math
import random
import warnings

import pytest
import torch

from focus_pretrain.config import Config, ProbesConfig, load_config
from focus_pretrain.data import Tokenizer, demo_documents, train_tokenizer
from focus_pretrain.train.distance import distance_masks
from focus_pretrain.train.probes import FILLER, probe_batches, probe_metrics


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    prefix = tmp_path_factory.mktemp("tok") / "demo"
    texts = list(demo_documents(150, seed=1)) + [" ".join(FILLER)] * 5
    return Tokenizer(train_tokenizer(texts, prefix, vocab_size=400))


class CopyOracle(torch.nn.Module):
    """A perfect in-context copier (an idealised induction head) with the Megatron call
    signature: at each position it finds the longest earlier match (>= ``min_match`` tokens)
    of the text ending here, latest first, and predicts the token that followed it, if that
    token is visible (``window``: only keys ``0 <= i - j <= window``; ``None``: all). With no
    visible match its logits are uniform."""

    def __init__(self, vocab: int, window: int | None = None, min_match: int = 3) -> None:
        super().__init__()
        self.vocab, self.window, self.min_match = vocab, window, min_match

    def forward(self, tokens, positions, mask):  # [b, s] -> [b, s, vocab]
        b, s = tokens.shape
        logits = torch.zeros(b, s, self.vocab)
        for r in range(b):
            x = tokens[r]
            eq = (x[:, None] == x[None, :]).long()  # [s, s]
            run = torch.zeros(s, s, dtype=torch.long)  # run[i, j]: match length ending i, j
            for i in range(s):
                run[i] = eq[i] * (
                    1 + (torch.cat([run[i - 1, :1] * 0, run[i - 1, :-1]]) if i else 0)
                )
            for i in range(s):
                j = torch.arange(s)
                ok = (j + 1 <= i) & (run[i] >= self.min_match)  # the copied token j+1 is past
                if self.window is not None:
                    ok &= i - (j + 1) <= self.window
                if ok.any():
                    score = torch.where(ok, run[i] * s + j, -1)  # longest, then latest
                    logits[r, i, x[int(score.argmax()) + 1]] = 30.0
        return logits


def _config(lengths, **extra) -> ProbesConfig:
    return ProbesConfig(lengths=lengths, **extra)


@pytest.mark.parametrize("kind", ["passkey", "multikey"])
def test_needles_and_answers_are_where_the_batch_says(tokenizer, kind):
    config = _config([256, 384], depths=[0.0, 0.5, 1.0], count=3, kinds=[kind], keys=3)
    for batch in probe_batches(tokenizer, config, seed=5):
        n = 3 * 3
        assert batch.tokens.shape == batch.labels.shape == (n, batch.length)
        assert (batch.tokens[:, 1:] == batch.labels[:, :-1]).all()
        assert (batch.answer_mask.sum(dim=1) >= config.digits).all()
        for row in range(n):
            text = tokenizer.decode([*batch.tokens[row].tolist(), int(batch.labels[row, -1])])
            answer = tokenizer.decode(batch.labels[row][batch.answer_mask[row]].tolist())
            assert len(answer) == config.digits and answer.isdigit()
            assert text.rstrip().endswith(answer), "the answer ends the sequence"
            needle = f"is {answer}."
            assert text.count(needle) == 1, "the asked needle holds the answer once"
            # the distance: from the needle's last digit to the query before the answer
            first_query = int(batch.answer_mask[row].nonzero()[0]) - 0
            last_digit = max(
                p
                for p in range(first_query)
                if tokenizer.decode(batch.tokens[row, : p + 1].tolist()).endswith(needle[:-1])
            )
            assert int(batch.distance[row]) == first_query - last_digit
        by_depth = batch.distance.view(3, 3).float().mean(dim=1)  # [depths]
        assert by_depth[0] > by_depth[1] > by_depth[2], "deeper needles sit closer to the end"


def test_probes_are_deterministic_and_depend_on_the_seed(tokenizer):
    config = _config([256], count=2)
    a, b = probe_batches(tokenizer, config, 1), probe_batches(tokenizer, config, 1)
    c = probe_batches(tokenizer, config, 2)
    assert all(torch.equal(x.tokens, y.tokens) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x.tokens, y.tokens) for x, y in zip(a, c, strict=True))


def test_a_perfect_copier_scores_everything_and_its_window_twin_chance_beyond(tokenizer):
    window = 96  # depth 1: right before the question (a distractor may follow it)
    config = _config([256], depths=[0.0, 1.0], count=3, keys=3)
    batches = probe_batches(tokenizer, config, seed=3)
    for batch in batches:  # depth 0 is far beyond the window, depth 1 inside it
        assert (batch.distance[:3] > window).all() and (batch.distance[3:] <= window).all()
    vocab = tokenizer.vocab_size
    full = probe_metrics(CopyOracle(vocab), batches, window, 4, torch.device("cpu"))
    local = probe_metrics(CopyOracle(vocab, window), batches, window, 4, torch.device("cpu"))
    for kind in ("passkey", "multikey"):
        assert full[f"{kind}_acc"] == 1.0 and full[f"{kind}_exact"] == 1.0, full
        assert full[f"{kind}_far_acc"] == full[f"{kind}_near_acc"] == 1.0
        assert full[f"{kind}_loss"] < 1e-6
        assert local[f"{kind}_near_acc"] == 1.0, local
        assert local[f"{kind}_far_acc"] <= 0.1, local  # chance: uniform over the vocabulary
        assert local[f"{kind}_L256_d00_loss"] == pytest.approx(math.log(vocab), rel=1e-4)
        assert local[f"{kind}_L256_d100_acc"] == 1.0
        assert 0.4 < local[f"{kind}_acc"] < 0.6 and local[f"{kind}_exact"] == 0.5


def test_bad_probe_settings_are_refused_naming_the_key(tokenizer):
    with pytest.raises(ValueError, match=r"probes\.lengths.*beyond model\.max_seq_length"):
        load_config(
            None, ["model.max_seq_length=512", "data.seq_length=512", "probes.lengths=[1024]"]
        )
    with pytest.raises(ValueError, match=r"probes\.lengths\[\] \(250\) must be divisible by 2"):
        load_config(None, ["probes.lengths=[250]", "parallel.context_parallel_size=2"])
    with pytest.raises(ValueError, match=r"probes\.kinds\[\] must be one of"):
        load_config(None, ["probes.lengths=[256]", "probes.kinds=[haystack]"])
    with pytest.raises(ValueError, match=r"probes\.depths\[\] must be numbers in \[0, 1\]"):
        load_config(None, ["probes.lengths=[256]", "probes.depths=[1.5]"])
    with pytest.raises(ValueError, match=r"too short for a multikey probe.*lower probes\.keys"):
        probe_batches(tokenizer, _config([32], kinds=["multikey"], keys=4))
    assert isinstance(load_config(None, ["probes.lengths=[256]"]), Config)


def _brute_force_masks(tokens, labels, window, eod):
    n, s = tokens.shape
    beyond = torch.zeros(n, s, dtype=torch.bool)
    far = torch.zeros(n, s, dtype=torch.bool)
    for r in range(n):
        for p in range(s):
            if tokens[r, p] == eod:
                continue
            start = max([q + 1 for q in range(p) if tokens[r, q] == eod], default=0)
            beyond[r, p] = p - start > window
            seen = [q for q in range(start, p + 1) if tokens[r, q] == labels[r, p]]
            far[r, p] = labels[r, p] != eod and bool(seen) and p - max(seen) > window
    return beyond, far


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_distance_masks_match_a_brute_force_definition(seed):
    rng = random.Random(seed)
    eod, window = 0, rng.choice([2, 5, 9])
    ids = torch.tensor([[rng.choice([eod] + list(range(1, 12)) * 6) for _ in range(61)]
                        for _ in range(3)])  # fmt: skip
    tokens, labels = ids[:, :-1], ids[:, 1:]
    masks = distance_masks(tokens, labels, window, eod)
    beyond, far = _brute_force_masks(tokens, labels, window, eod)
    assert torch.equal(masks["beyond_window"], beyond)
    assert torch.equal(masks["far_evidence"], far)
    assert far.any() and beyond.any() and not far.all()


def test_position_buckets_match_a_brute_force_loop():
    """The loss by position: edges from the window doubling to the length; each bucket's sum
    and count of the valid tokens equal a loop over the tokens, by index or by the positions
    a packed batch resets per document."""
    from focus_pretrain.train.validate import _position_sums, position_edges

    assert position_edges(16, 128) == [0, 16, 32, 64, 128]
    assert position_edges(16, 100) == [0, 16, 32, 64, 100]
    assert position_edges(0, 100) == [0, 64, 100] and position_edges(200, 100) == [0, 100]
    gen = torch.Generator().manual_seed(3)
    loss = torch.rand(3, 100, generator=gen) * 5  # [b, s]
    valid = torch.rand(3, 100, generator=gen) > 0.2
    reset = torch.cat([torch.arange(40), torch.arange(60)]).expand(3, 100)  # [b, s]
    edges = position_edges(16, 100)
    for positions in (None, reset):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # e.g. torch's note on a non-contiguous input
            got = _position_sums(loss, valid, positions, edges)
        want = torch.zeros(len(edges) - 1, 2, dtype=torch.float64)
        for b in range(3):
            for s in range(100):
                if valid[b, s]:
                    where = s if positions is None else int(positions[b, s])
                    bucket = max(i for i in range(len(edges) - 1) if edges[i] <= where)
                    want[bucket] += torch.tensor([float(loss[b, s]), 1.0], dtype=torch.float64)
        torch.testing.assert_close(got, want)
