"""distserver.runtime."""
