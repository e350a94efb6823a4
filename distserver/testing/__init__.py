"""distserver.testing."""
