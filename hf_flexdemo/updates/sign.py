"""``sign``: DeMo's rule. Each entry moves by ``lr`` in the direction of the decoded update (``sign=False``: by
``lr`` times the update itself)."""

from __future__ import annotations

from ..schemes.base import StepContext
from .base import Decoded, UpdateRule


class SignRule(UpdateRule):
    name = "sign"

    def apply(self, decoded: list[Decoded], ctx: StepContext) -> None:
        for item in decoded:
            update = item.update
            self.subtract(item, update.sign_() if item.bucket.group["sign"] else update)
