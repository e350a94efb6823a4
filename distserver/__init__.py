"""distserver: TensorFlow's distributed runtime server in pure, asyncio-native Python."""
