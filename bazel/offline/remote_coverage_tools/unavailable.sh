#!/bin/sh
echo "remote_coverage_tools is an offline stand-in: bazel coverage is not supported by the offline check" >&2
exit 1
