"""Run a command; print its wall time and peak RSS (of it and its children) as JSON."""

import json
import resource
import subprocess
import sys
import time

t = time.perf_counter()
p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
_, err = p.communicate()
peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(json.dumps({"rc": p.returncode, "wall_s": time.perf_counter() - t,
                  "peak_rss_bytes": peak_kb * 1024, "stderr": err.decode()[-500:]}))
