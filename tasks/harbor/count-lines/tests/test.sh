#!/bin/bash
mkdir -p /logs/verifier
want=$(grep -c a /app/data/words.txt)
got=$(tr -d '[:space:]' < /app/answer.txt 2>/dev/null)
if [ "$got" = "$want" ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
