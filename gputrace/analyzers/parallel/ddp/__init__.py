"""Data parallelism: DDP's gradient buckets replayed under other settings, with its
findings and the comm timeline it draws."""
