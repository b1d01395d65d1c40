#!/usr/bin/env bash
# GLM-Image on two GPU nodes: the AR stage (vLLM, tensor parallel over AR_TP GPUs) and the API
# server on the head node; the DiT stage on a headless node. The AR -> DiT payload (the prior
# token ids) crosses over NIXL: a small descriptor rides the control connection and the DiT
# node pulls the payload with a NIXL READ (UCX: RDMA where the NICs have it, else TCP).
#
#   head node:  ROLE=head HEAD_IP=10.0.0.1 AR_TP=2 ./examples/two_node_glm_image.sh
#   DiT node:   ROLE=node HEAD_IP=10.0.0.1 DIT_TP=1 ./examples/two_node_glm_image.sh
#
# Start them in any order: the node retries until the head listens; the head answers 503
# (and /health is unhealthy) until the DiT node has registered. Restart either at will: a
# node that dies fails its in-flight requests with 503 at once, and serving resumes when it
# registers again. Both nodes need the same checkpoint path (MODEL) and the same secret
# VLLM_OMNI_AUTHKEY (e.g. `openssl rand -hex 32`): the head's node registry listens on
# 0.0.0.0 here, which vllm serve refuses without it. The key authenticates both ends of the
# control connection (typed messages, never pickle); keep the registry port on a private
# network all the same.
set -euo pipefail

ROLE=${ROLE:?set ROLE=head or ROLE=node}
HEAD_IP=${HEAD_IP:?set HEAD_IP to the head node address the DiT node can reach}
MODEL=${MODEL:-zai-org/GLM-Image}
CONFIG=${CONFIG:-glm_image_nixl}          # bundled: stage_configs/glm_image_nixl.yaml
MASTER_PORT=${MASTER_PORT:-29600}        # head's node registry (control connection)
HTTP_PORT=${HTTP_PORT:-8000}
export AR_TP=${AR_TP:-1}                 # GPUs of the AR stage (tensor_parallel_size)
export DIT_TP=${DIT_TP:-1}               # GPUs of the DiT stage
export VLLM_OMNI_AUTHKEY=${VLLM_OMNI_AUTHKEY:?set the same secret VLLM_OMNI_AUTHKEY on both nodes}
# UCX picks the fastest transport; pin the NIC if the default route is not the data network,
# e.g. NIC=mlx5_0:1 (RDMA) or NIC=eth1 (TCP).
if [ -n "${NIC:-}" ]; then export UCX_NET_DEVICES=$NIC; fi
export NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN}

gpus() {  # "0,1,...,n-1"
  seq -s, 0 $(($1 - 1))
}

case "$ROLE" in
  head)
    export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-$(gpus "$AR_TP")}
    exec vllm serve "$MODEL" --stage-config "$CONFIG" \
      --stage-ids 0 \
      --omni-master-address 0.0.0.0 --omni-master-port "$MASTER_PORT" \
      --host 0.0.0.0 --port "$HTTP_PORT"
    ;;
  node)
    export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-$(gpus "$DIT_TP")}
    exec vllm serve "$MODEL" --stage-config "$CONFIG" \
      --headless --stage-ids 1 \
      --omni-master-address "$HEAD_IP" --omni-master-port "$MASTER_PORT"
    ;;
  *)
    echo "ROLE must be head or node, not $ROLE" >&2
    exit 2
    ;;
esac
