#!/usr/bin/env bash
# Screenshot of the MLflow UI comparing the runs of an experiment (for the README).
# Needs Debian's chromium (apt-get install chromium). Usage: scripts/mlflow_screenshot.sh OUT.png [EXPERIMENT]
set -euo pipefail
out="${1:?output png}"; experiment="${2:-grpoflow}"
store="sqlite:///runs/mlflow.db"; port=5077
MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false mlflow ui --backend-store-uri "$store" --host 127.0.0.1 --port "$port" --workers 1 >/tmp/mlflow-ui.log 2>&1 &
ui=$!
trap 'kill $ui 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
url=$(python - "$store" "$experiment" "$port" <<'PY'
import json, sys, urllib.parse
from mlflow.tracking import MlflowClient
store, name, port = sys.argv[1:]
c = MlflowClient(store)
exp = c.get_experiment_by_name(name)
runs = [r.info.run_id for r in c.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"])][:2]
q = urllib.parse.urlencode({"runs": json.dumps(runs), "experiments": json.dumps([exp.experiment_id])})
print(f"http://127.0.0.1:{port}/#/compare-runs?{q}")
PY
)
chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking \
  --disable-component-update --disable-sync --user-data-dir="$(mktemp -d)" --hide-scrollbars \
  --window-size=1500,1100 --virtual-time-budget=15000 --screenshot="$out" "$url"
echo "wrote $out from $url"
