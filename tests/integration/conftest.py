"""Fixtures of the integration tests that more than a helper module defines."""

from tests.integration.raw_id_models import archives, trained, trained_on  # noqa: F401  (raw-id models)
