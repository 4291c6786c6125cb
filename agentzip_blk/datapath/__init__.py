"""What runs in the server process on the data path: the front doors that hand block
requests to the store (the nbdkit plugin glue lives in nbdkit/agentzip_plugin.py; the FUSE
front door is `datapath.fuse`)."""
