"""Errors of the model description and its weights, raised at build time and when a worker
builds an eager model."""

from __future__ import annotations

from handlers.runtime.errors import InputError


class SpecError(InputError):
    """The model spec (YAML) is invalid; the message starts with the key path."""


class CheckpointError(InputError):
    """A checkpoint does not match the model: lists every missing, unexpected and mis-shaped key."""
