#!/bin/sh
echo "bazel coverage is not supported in refit's offline build" >&2
exit 1
