#!/usr/bin/env bash
# GLM-Image split over two GPU nodes: the AR stage (vLLM) with the API server on the head node,
# the DiT stage on a headless node; the AR -> DiT payload crosses over NIXL (a descriptor rides
# the control connection, the DiT node pulls the payload with a NIXL READ).
#
#   head node:  ROLE=head ./examples/two_node_glm_image.sh
#   DiT node:   ROLE=node HEAD_IP=10.0.0.1 ./examples/two_node_glm_image.sh
#
# Sizing (each node uses its own visible GPUs):
#   AR_TP   tensor-parallel size of the AR stage on the head   (default 1; GPUs 0..AR_TP-1)
#   DIT_TP  tensor-parallel size of the DiT stage on the node  (default 1; GPUs 0..DIT_TP-1)
# Other knobs: MODEL (hub id or local dir), PORT (HTTP, head), MASTER_PORT (node registration),
# NIC (network interface UCX should use, e.g. ib0 or eth0; default: UCX picks), UCX_TLS.
set -euo pipefail

ROLE=${ROLE:?set ROLE=head or ROLE=node}
MODEL=${MODEL:-zai-org/GLM-Image}
PORT=${PORT:-8000}
MASTER_PORT=${MASTER_PORT:-29600}
export AR_TP=${AR_TP:-1}
export DIT_TP=${DIT_TP:-1}
export NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN}
if [[ -n "${NIC:-}" ]]; then
  export UCX_NET_DEVICES="$NIC"
fi
# UCX_TLS: leave unset to let UCX pick RDMA when present; never set it empty (agent creation
# fails) and keep tcp in any explicit list (NIXL asks for peer error handling).

gpus() { seq -s, 0 $(($1 - 1)); }

case "$ROLE" in
  head)
    export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-$(gpus "$AR_TP")}
    exec vllm serve "$MODEL" --stage-config glm_image_nixl \
      --stage-ids 0 --omni-master-port "$MASTER_PORT" --port "$PORT"
    ;;
  node)
    HEAD_IP=${HEAD_IP:?set HEAD_IP to the head node address}
    export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-$(gpus "$DIT_TP")}
    exec vllm serve "$MODEL" --stage-config glm_image_nixl --headless \
      --stage-ids 1 --omni-master-address "$HEAD_IP" --omni-master-port "$MASTER_PORT"
    ;;
  *)
    echo "ROLE must be head or node, got '$ROLE'" >&2
    exit 2
    ;;
esac
