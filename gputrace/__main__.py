from gputrace.cli import entry

raise SystemExit(entry())
