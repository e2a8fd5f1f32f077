#!/bin/bash
# The oracle's answer.
set -eu
mkdir -p /app
echo "hello from cleanroom" > /app/greeting.txt
