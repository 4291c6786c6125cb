"""Names vulture reports as unused that something does use (tests/test_lint.py).

Vulture reads this file as code that uses each name here; nothing imports or runs it. Keep
it short: a name belongs here only when its user is outside Python's view, with that user
named. Anything else vulture finds in the package is dead: remove it.
"""
# ruff: noqa: F821

# nbdkit calls the plugin's callbacks by name (datapath/nbdkit_plugin.py)
thread_model, config_complete, block_size, readonly
can_write, can_flush, can_trim, can_zero, can_fast_zero, can_multi_conn

# http.server calls and reads these by name (fleet/k8s/webhook.py, fleet/metrics.py)
_.do_POST, _.log_message, _.protocol_version, _.close_connection, _.daemon_threads

# FUSE opcodes listed for completeness of the protocol table; answered ENOSYS (datapath/fuse.py)
GETXATTR, LISTXATTR

# Dataclass fields read as a whole: the store's Counters (dataclasses.asdict in
# store/accounting.stats), a cgroup's stats row (cli/stats.py reads it by key) and the run
# state file (runstate.RunState, saved as JSON)
_.zeroes, _.bytes_read, _.bytes_written, _.enospc, _.dedup_hits, _.hash_collisions
_.demotions, _.returned_demotions, _.direct_to_disk, _.disk_full, _.disk_errors
_.compactions, _.pages_moved, _.hot_hits, _.frames_written, _.frame_fallbacks, _.frame_hits
_.frames_rewritten, _.frames_incompressible, _.kernel_freed_pages
_.kernel_swap
_.mkswap_done

# a retry loop's counter (demo/driver.py)
attempt

# run inside a subprocess's code string (tests/reliability/test_protection.py)
dumpable
