"""What runs inside the server process: the Server (`server`) over the store, the plugin
nbdkit loads (`nbdkit_plugin.py`), the JSON control socket (`control`), memory and signal
protection (`protect`, `guard`), request latency (`latency`), and the FUSE front door that
serves the loop device's file from the same store (`fuse`).

Kept light: the plugin imports `protect` from here before anything heavy is loaded."""
