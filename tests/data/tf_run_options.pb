Ü(2%"#
xDebugIdentity"file:///tmp/dbg8B