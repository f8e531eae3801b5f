"""A draft block whose tokens are still pending on a device: length and truncation never read them."""

from __future__ import annotations

from mlx_dspark.domain.drafting.block import DraftBlock


class Pending:
    """A PendingTokens that counts how often its values are read."""

    def __init__(self, values: tuple[int, ...], reads: list[int]) -> None:
        self.values = values
        self.reads = reads

    def __len__(self) -> int:
        return len(self.values)

    def read(self) -> tuple[int, ...]:
        self.reads[0] += 1
        return self.values

    def head(self, n: int) -> Pending:
        return Pending(self.values[:n], self.reads)


def test_a_pending_block_reads_its_tokens_only_when_asked() -> None:
    reads = [0]
    block = DraftBlock(pending=Pending((4, 8, 15, 16), reads), q=[[0.1]] * 4, source="drafter")
    short = block.truncated(2)
    assert len(block) == 4 and len(short) == 2 and block.truncated(9) is block
    assert reads == [0]
    assert short.tokens == (4, 8) and short.q == [[0.1]] * 2
    assert block.tokens == (4, 8, 15, 16)
    assert reads == [2]


def test_a_host_block_is_unchanged() -> None:
    block = DraftBlock(tokens=(1, 2, 3), source="lookup")
    assert block.pending is None and len(block) == 3
    assert block.truncated(1) == DraftBlock(tokens=(1,), source="lookup")
