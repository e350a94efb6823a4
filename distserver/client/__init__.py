"""distserver.client."""
