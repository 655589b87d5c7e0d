# The GPU rounds' one helper: `step NAME LIMIT CMD...` runs CMD under `timeout LIMIT`, its output in
# $OUT/NAME.log, its status and seconds in $OUT/summary.log, and prints the log's last ${TAILN:-25} lines.
step() { local name=$1 limit=$2; shift 2; echo "== $name" | tee -a $OUT/summary.log
  local t0=$(date +%s); timeout $limit "$@" > $OUT/$name.log 2>&1; local rc=$?
  echo "   rc=$rc $(( $(date +%s) - t0 )) s" | tee -a $OUT/summary.log; tail -${TAILN:-25} $OUT/$name.log; }
