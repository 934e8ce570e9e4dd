#!/bin/sh
# Entry point of the aiocoll coordinator image (see Dockerfile and docs/CONTAINER.md).
#
# Finds the shared token before starting `aiocoll coordinator`, because a coordinator in a
# container listens on every interface: anyone who can reach the port could join a job.
#   1. an explicit `--token-file F` on the command line wins;
#   2. else AIOCOLL_TOKEN_FILE names a mounted file;
#   3. else a mounted secret at /run/secrets/aiocoll_token is used when present;
#   4. else AIOCOLL_TOKEN from the environment (read by the coordinator itself);
#   5. else it refuses to start, unless AIOCOLL_ALLOW_NO_TOKEN=1 says an open port is intended.
# Any other command (a shell, `aiocoll status`) runs unchanged.
set -eu

if [ "$#" -ge 2 ] && [ "$1" = "aiocoll" ] && [ "$2" = "coordinator" ]; then
    has_token_file=0
    for arg in "$@"; do
        case "$arg" in
            --token-file|--token-file=*) has_token_file=1 ;;
        esac
    done
    if [ "$has_token_file" = 0 ]; then
        token_file="${AIOCOLL_TOKEN_FILE:-}"
        if [ -z "$token_file" ] && [ -f /run/secrets/aiocoll_token ]; then
            token_file=/run/secrets/aiocoll_token
        fi
        if [ -n "$token_file" ]; then
            if [ ! -r "$token_file" ]; then
                echo "aiocoll: the token file $token_file is missing or not readable by uid $(id -u);" \
                     "mount it read-only and readable by that user" >&2
                exit 64
            fi
            set -- "$@" --token-file "$token_file"
        elif [ -z "${AIOCOLL_TOKEN:-}" ] && [ "${AIOCOLL_ALLOW_NO_TOKEN:-0}" != 1 ]; then
            echo "aiocoll: no token given, and this coordinator listens on every interface." >&2
            echo "  Pass one with -e AIOCOLL_TOKEN=SECRET, or mount a file and set AIOCOLL_TOKEN_FILE" >&2
            echo "  (or mount it at /run/secrets/aiocoll_token). Set AIOCOLL_ALLOW_NO_TOKEN=1 to run" >&2
            echo "  without one on a network you trust." >&2
            exit 64
        fi
    fi
fi
exec "$@"
