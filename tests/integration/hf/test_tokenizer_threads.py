"""The tokenizer adapter is safe to use from several threads: its calls are serialised, and what each thread
gets is what it gets alone (the engine thread detokenizes while a server worker checks a queued prompt)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np

from mlx_dspark.adapters.hf.loader import HfModelLoader
from mlx_dspark.adapters.hf.tokenizer import HfTokenizer
from mlx_dspark.application.settings import ModelSettings
from tests.integration.hf import tiny_models as tm


def _tokenizer(tmp_path: Path) -> HfTokenizer:
    _, weights = tm.build_reference("qwen2")
    path = tm.write_mlx_dir("qwen2", weights, tmp_path / "tiny-qwen2")
    loader = HfModelLoader(ModelSettings(cache_dir=str(tmp_path / "cache")))
    return HfTokenizer(loader.load_checkpoint(str(path)).tokenizer)


def test_concurrent_calls_are_serialised_and_each_gets_its_own_answer(tmp_path: Path) -> None:
    tok = _tokenizer(tmp_path)
    inside, most = 0, 0
    guard = threading.Lock()
    encode = tok._hf.encode

    def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal inside, most
        with guard:
            inside += 1
            most = max(most, inside)
        try:
            return encode(*args, **kwargs)
        finally:
            with guard:
                inside -= 1

    tok._hf.encode = counting
    rng = np.random.default_rng(0)
    words = tm.vocabulary()
    texts = [" ".join(rng.choice(words, size=int(rng.integers(1, 40)))) for _ in range(64)]
    alone = [tok.encode(t, add_special_tokens=False) for t in texts]
    results: dict[int, tuple[list[int], str]] = {}
    start = threading.Barrier(8)

    def work(k: int) -> None:
        start.wait()
        for i in range(k, len(texts), 8):
            ids = tok.encode(texts[i], add_special_tokens=False)
            results[i] = (ids, tok.decode(ids))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [results[i][0] for i in range(len(texts))] == alone
    assert [results[i][1] for i in range(len(texts))] == [tok.decode(ids) for ids in alone]
    assert most == 1  # never two calls inside the tokenizer at once
