"""Draft tokens that stay on the device until the verify that checks them reads them back.

A drafter returns its tokens as `DeviceTokens` after queuing them with `mx.async_eval`; the MLX target
feeds the device array straight into its verify forward and reads the tokens back together with the
verdict, so a speculative round waits on the device once. Any other reader gets them with `read()`.
"""

from __future__ import annotations

from typing import cast

import mlx.core as mx


class DeviceTokens:
    """int32 token ids [n] on the device (the domain's `PendingTokens`)."""

    def __init__(self, array: mx.array, values: tuple[int, ...] | None = None) -> None:
        self.array = array
        self._values = values

    def __len__(self) -> int:
        return int(self.array.shape[0])

    def read(self) -> tuple[int, ...]:
        if self._values is None:
            self._values = tuple(cast(list[int], self.array.tolist()))
        return self._values

    def head(self, n: int) -> DeviceTokens:
        return DeviceTokens(self.array[:n], None if self._values is None else self._values[:n])

    def known(self, values: tuple[int, ...]) -> None:
        """The values, read back by someone else with what they computed from them."""
        self._values = values
