"""`kvfold verify`: is an exported directory intact (integrity.py), and does it serve what its
manifest promises (serving.py)? Both return named checks; verify.py puts them together."""

from kvfold.verify.report import Check, VerifyReport
from kvfold.verify.verify import DEFAULT_TEXTS, verify

__all__ = ["DEFAULT_TEXTS", "Check", "VerifyReport", "verify"]
