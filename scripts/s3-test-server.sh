#!/usr/bin/env bash
# s3-test-server.sh DIR PORT_BASE — start a SeaweedFS S3 server on loopback for tests.
#
# Installs SeaweedFS (scripts/install-test-servers.sh), starts `weed mini` with its data in
# DIR, every port on 127.0.0.1 counted from PORT_BASE (S3 = PORT_BASE), SigV4 credentials
# crabtest / crabtestsecret and a bucket `crab`, waits until the bucket answers, and prints
# the variables a client needs (AWS_*), then `WEED_PID=<pid>`. Stop it with kill WEED_PID.
set -euo pipefail
DIR=$1
BASE=$2
SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
WEED=$("$SCRIPT_DIR/install-test-servers.sh" | tail -n 1)
mkdir -p "$DIR/data"
cat >"$DIR/s3.json" <<JSON
{"identities":[{"name":"crab","credentials":[{"accessKey":"crabtest","secretKey":"crabtestsecret"}],
  "actions":["Admin","Read","Write","List","Tagging"]}]}
JSON
setsid "$WEED" mini -dir="$DIR/data" -ip=127.0.0.1 -ip.bind=127.0.0.1 \
    -s3.port="$BASE" -s3.port.grpc=$((BASE + 1)) -master.port=$((BASE + 2)) \
    -master.port.grpc=$((BASE + 3)) -volume.port=$((BASE + 4)) -volume.port.grpc=$((BASE + 5)) \
    -filer.port=$((BASE + 6)) -filer.port.grpc=$((BASE + 7)) -admin.port=$((BASE + 8)) \
    -admin.port.grpc=$((BASE + 9)) -webdav.port=$((BASE + 10)) -s3.port.iceberg=0 \
    -admin.ui=false -master.telemetry=false -s3.config="$DIR/s3.json" -bucket=crab \
    >"$DIR/weed.log" 2>&1 </dev/null &
PID=$!
for _ in $(seq 1 300); do
    if ! kill -0 "$PID" 2>/dev/null; then
        echo "s3-test-server: weed exited; its log:" >&2
        tail -n 30 "$DIR/weed.log" >&2
        exit 1
    fi
    code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$BASE/crab" || true)
    # Unsigned requests are refused (403) once the bucket and the auth are up.
    if [[ "$code" == 403 || "$code" == 200 ]]; then
        echo "AWS_ENDPOINT_URL=http://127.0.0.1:$BASE"
        echo "AWS_ACCESS_KEY_ID=crabtest"
        echo "AWS_SECRET_ACCESS_KEY=crabtestsecret"
        echo "AWS_REGION=us-east-1"
        echo "WEED_PID=$PID"
        exit 0
    fi
    sleep 0.2
done
echo "s3-test-server: no answer on 127.0.0.1:$BASE after 60 s; log in $DIR/weed.log" >&2
kill "$PID" 2>/dev/null || true
exit 1
