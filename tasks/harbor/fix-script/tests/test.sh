#!/bin/bash
# Partial credit as reward.json: Harbor reads its "reward" key before reward.txt.
mkdir -p /logs/verifier
cd /app
passed=0
for case in "2 3 5" "10 -4 6" "0 0 0" "7 8 15"; do
  set -- $case
  [ "$(python3 add.py "$1" "$2" 2>/dev/null)" = "$3" ] && passed=$((passed + 1))
done
python3 -c "import json; print(json.dumps({'reward': $passed / 4, 'cases_passed': $passed}))" > /logs/verifier/reward.json
