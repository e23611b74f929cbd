#!/bin/sh
# Make the certificates the rendezvous etcd runs on: TLS on its client and peer
# ports, and only clients with a certificate of this CA admitted
# (--client-cert-auth). Whoever can write the rendezvous key runs code in every
# agent (torch unpickles the rendezvous state), so etcd admits the trainers only.
#
#   deploy/k8s/make-etcd-certs.sh DIR [NAMESPACE] [DAYS]
#
# makes, with openssl (EC P-256 keys, mode 0600):
#   DIR/ca.crt, DIR/ca.key                      the CA: keep ca.key off the cluster
#   DIR/etcd-server/{ca.crt,tls.crt,tls.key}    etcd's server and peer certificate
#                                               -> Secret etcd-server-tls
#   DIR/etcd-client/{ca.crt,tls.crt,tls.key}    the trainers' client certificate
#                                               -> Secret etcd-client-tls
# and prints the kubectl commands that create those Secrets, and the job's
# snapshot-signing secret, in NAMESPACE (default torchrevive). The server
# certificate names etcd's Services in NAMESPACE (etcd-client, etcd-0.etcd, with
# and without .NAMESPACE.svc.cluster.local) and 127.0.0.1 (etcdctl inside the
# pod). DAYS (default 365) is how long the certificates last: to renew, run it
# again with a new DIR, replace the two Secrets and restart etcd and the trainers.
set -eu

usage() {
    echo "usage: $0 DIR [NAMESPACE] [DAYS]  (DIR must not exist yet)" >&2
    exit 2
}
[ $# -ge 1 ] && [ $# -le 3 ] || usage
dir=$1
namespace=${2:-torchrevive}
days=${3:-365}
case $namespace in
    ''|*[!a-z0-9-]*) echo "$0: NAMESPACE '$namespace' is not a Kubernetes namespace name" >&2; exit 2 ;;
esac
case $days in
    ''|*[!0-9]*) echo "$0: DAYS '$days' is not a whole number of days" >&2; exit 2 ;;
esac
if [ -e "$dir" ]; then
    echo "$0: $dir exists; give a new directory (nothing there is overwritten)" >&2
    exit 2
fi
command -v openssl >/dev/null || { echo "$0: openssl is not installed" >&2; exit 2; }

umask 077
mkdir -p "$dir/etcd-server" "$dir/etcd-client"
cd "$dir"

key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }
sign() {  # sign NAME SUBJECT EXTENSIONS -> NAME/tls.crt, NAME/tls.key
    key "$1/tls.key"
    openssl req -new -key "$1/tls.key" -subj "$2" -out "$1/tls.csr"
    printf '%s\n' "$3" > "$1/ext.cnf"
    openssl x509 -req -in "$1/tls.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days "$days" -sha256 \
        -extfile "$1/ext.cnf" -out "$1/tls.crt" 2>/dev/null
    rm "$1/tls.csr" "$1/ext.cnf"
    cp ca.crt "$1/ca.crt"
}

key ca.key
openssl req -x509 -new -key ca.key -subj "/O=torchrevive/CN=torchrevive etcd CA ($namespace)" -days "$days" \
    -sha256 -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign -out ca.crt
san=""
for name in etcd-client etcd-0.etcd; do
    san="${san}DNS:$name,DNS:$name.$namespace,DNS:$name.$namespace.svc,DNS:$name.$namespace.svc.cluster.local,"
done
# Server and peer: etcd's JSON gateway and its peers dial it with this certificate, so it is good for both.
sign etcd-server "/O=torchrevive/CN=etcd" "subjectAltName=${san}DNS:localhost,IP:127.0.0.1
extendedKeyUsage=serverAuth,clientAuth
keyUsage=critical,digitalSignature,keyEncipherment"
# No common name: with etcd's auth turned on, a client certificate's CN would log it in as that user.
sign etcd-client "/O=torchrevive/OU=trainer" "extendedKeyUsage=clientAuth
keyUsage=critical,digitalSignature,keyEncipherment"
rm -f ca.srl
chmod 0644 ca.crt etcd-server/ca.crt etcd-server/tls.crt etcd-client/ca.crt etcd-client/tls.crt

cat <<EOF
$0: made $dir (keep $dir/ca.key off the cluster). Create the Secrets (once, before kubectl apply -k):
  kubectl create namespace $namespace
  kubectl -n $namespace create secret generic etcd-server-tls --from-file=$dir/etcd-server
  kubectl -n $namespace create secret generic etcd-client-tls --from-file=$dir/etcd-client
  kubectl -n $namespace create secret generic torchrevive-snapshot-secret --from-file=secret=<(openssl rand -hex 32)   # bash
EOF
