"""Certificates and keys for a Flower deployment: a CA, the SuperLink's TLS certificate, SuperNode key pairs.

    fedspear certs deploy/ --host 10.0.0.5 --host superlink.lan --node node-0 --node node-1

What Flower 1.41–1.42 reads, and from where:

- ``flower-superlink --ssl-ca-certfile ca.pem --ssl-certfile server.pem --ssl-keyfile server.key``: one TLS
  certificate for the Fleet, Control and Runtime APIs (all on one HTTP port). Its subject alternative names must
  hold every address the SuperNodes, the ``flwr`` CLI and the SuperLink's own SuperExec use to reach it (the
  SuperExec dials the ``--host`` it binds to, so 127.0.0.1 is always included).
- ``flower-supernode --root-certificates ca.pem``: the CA that signed the server certificate.
- SuperNode authentication (``flower-superlink --enable-supernode-auth``): each SuperNode holds an EC private key on
  a NIST curve in OpenSSH format (``--auth-supernode-private-key``; Flower's docs make them with
  ``ssh-keygen -t ecdsa -b 384``) and its public key (OpenSSH one-liner) is registered with
  ``flwr supernode register node.pub <connection>``. A SuperNode whose key is not registered is refused.

Only ``cryptography`` is used (a dependency of Flower); no ``openssl`` binary, no Flower import. Private keys are
written with mode 0600. This is a self-signed CA for a lab or a closed group of machines; a public SuperLink would
use a certificate from a real CA instead.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_HOSTS = ("127.0.0.1", "localhost")
CURVE = ec.SECP384R1  # what `ssh-keygen -t ecdsa -b 384` makes; Flower accepts NIST curves only
# a DNS name (RFC 1123): dot-separated labels of letters, digits and inner hyphens, 1–63 characters each, the last
# not all digits (so a mistyped IP address such as 10.0.0.256 is no name); a leading "*." for a wildcard certificate
LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
DNS_NAME = re.compile(rf"(?=.{{1,253}}$)(?!(.*\.)?\d+\.?$)(\*\.)?{LABEL}(\.{LABEL})*\.?")


@dataclass(frozen=True)
class ServerCertificates:
    """Paths of the CA certificate and the SuperLink's certificate and private key (all PEM)."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path


@dataclass(frozen=True)
class NodeKeys:
    """Paths of one SuperNode's authentication key pair (OpenSSH private key, OpenSSH public one-liner)."""

    name: str
    private_key: Path
    public_key: Path


def _write_private(path: Path, data: bytes) -> None:
    """Write a private key readable by its owner only (created 0600, never world-readable even briefly)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedspear"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(hosts: Iterable[str]) -> x509.SubjectAlternativeName:
    """IP addresses as IP entries, anything else as a DNS name.

    Raises:
        ValueError: a host is neither an IP address nor a DNS name.
    """
    entries: list[x509.GeneralName] = []
    for host in hosts:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            if not DNS_NAME.fullmatch(host):
                raise ValueError(f"host {host!r} is neither an IP address nor a DNS name") from None
            entries.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(entries)


def _canonical(host: str) -> str:
    """``host`` as certificates compare it: an IP address in its standard text form, a DNS name in lower case
    without a trailing dot."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host.lower().rstrip(".")


def _names(certificate: Path) -> set[str]:
    """The addresses (IPs and DNS names, ``_canonical``) a PEM certificate's subject alternative names hold."""
    cert = x509.load_pem_x509_certificate(certificate.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {_canonical(str(name)) for name in [*san.get_values_for_type(x509.IPAddress),
                                                *san.get_values_for_type(x509.DNSName)]}


def make_server_certificates(out_dir: str | Path, hosts: Iterable[str] = DEFAULT_HOSTS, days: int = 365,
                             overwrite: bool = False) -> ServerCertificates:
    """Write ``ca.pem``/``ca.key`` (a self-signed CA) and ``server.pem``/``server.key`` (signed by it) to ``out_dir``.

    Args:
        hosts: addresses the SuperLink is reached at (IPs and DNS names); 127.0.0.1 and localhost are always added.
        days: validity of both certificates.
        overwrite: replace existing files; otherwise existing files are kept and returned (so re-running a setup
            does not invalidate certificates already copied to SuperNodes).
    Raises:
        ValueError: ``days`` < 1 or past the year 9999; a host that is neither an IP address nor a DNS name; without
            ``overwrite``: some of the four files exist and others are missing (new ones would replace the CA the
            SuperNodes hold), or they all exist and the server certificate lacks a host asked for.
    """
    out = Path(out_dir)
    paths = ServerCertificates(out / "ca.pem", out / "ca.key", out / "server.pem", out / "server.key")
    hosts = list(dict.fromkeys([*DEFAULT_HOSTS, *hosts]))
    _san(hosts)  # every host checked before anything else
    present = [p for p in vars(paths).values() if p.is_file()]
    if not overwrite and len(present) == len(vars(paths)):
        named = _names(paths.server_cert)
        missing = [h for h in hosts if _canonical(h) not in named]
        if missing:
            raise ValueError(f"{paths.server_cert} exists and does not name {', '.join(missing)}; kept as it is. "
                             "--overwrite makes a new CA and certificate (every SuperNode then needs the new ca.pem)")
        return paths
    if not overwrite and present:
        lost = [p.name for p in vars(paths).values() if p not in present]
        raise ValueError(f"{out} holds {', '.join(p.name for p in present)} but not {', '.join(lost)}: new files would "
                         "replace the CA every SuperNode holds; restore the missing ones, or pass --overwrite to make "
                         "all four anew")
    if days < 1:
        raise ValueError(f"days must be at least 1 (got {days})")
    now = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5)  # tolerate small clock skew between machines
    try:
        until = now + dt.timedelta(days=days)
    except OverflowError:
        raise ValueError(f"days = {days} reaches past the year 9999") from None

    ca_key = ec.generate_private_key(CURVE())
    ca_name = _name("fedspear deployment CA")
    ca_cert = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(until)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    server_key = ec.generate_private_key(CURVE())
    server_cert = (
        x509.CertificateBuilder().subject_name(_name(hosts[0])).issuer_name(ca_name)
        .public_key(server_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now).not_valid_after(until)
        .add_extension(_san(hosts), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    pem = serialization.Encoding.PEM
    no_pass = serialization.NoEncryption()
    out.mkdir(parents=True, exist_ok=True)
    _write_private(paths.ca_key, ca_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, no_pass))
    paths.ca_cert.write_bytes(ca_cert.public_bytes(pem))
    _write_private(paths.server_key, server_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, no_pass))
    paths.server_cert.write_bytes(server_cert.public_bytes(pem))
    return paths


#: file stems of make_server_certificates' keys → whose key it is (a SuperNode key pair of that name would replace it)
RESERVED_NAMES = {"ca": "CA", "server": "SuperLink"}


def check_node_name(name: str) -> None:
    """Refuse a SuperNode key name that is not a plain file name; ``fedspear certs`` checks every ``--node`` with it
    before it writes anything. Control characters are refused too: a line break in the name would split the public
    key's one line (the name is its comment).

    Names ``ca`` and ``server`` are refused: ``<name>.key`` would replace the CA's or the SuperLink's private key
    (``make_server_certificates``' files in the same folder).

    Raises:
        ValueError: ``name`` is empty, contains a path separator or a control character, or is ``ca`` / ``server``.
    """
    if not name or "/" in name or os.sep in name or any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise ValueError(f"a node key name must be a plain file name (got {name!r})")
    if name in RESERVED_NAMES:
        raise ValueError(f"a node key name cannot be {name!r}: {name}.key is the {RESERVED_NAMES[name]}'s private "
                         "key in the same folder; give another name")


def make_node_keys(out_dir: str | Path, name: str, overwrite: bool = False) -> NodeKeys:
    """Write ``<name>.key`` (OpenSSH EC private key) and ``<name>.pub`` (its OpenSSH public key) to ``out_dir``.

    Raises:
        ValueError: ``name`` is not a plain file name (``check_node_name``).
    """
    check_node_name(name)
    out = Path(out_dir)
    keys = NodeKeys(name, out / f"{name}.key", out / f"{name}.pub")
    if not overwrite and keys.private_key.is_file() and keys.public_key.is_file():
        return keys
    key = ec.generate_private_key(CURVE())
    _write_private(keys.private_key, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                                       serialization.NoEncryption()))
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    keys.public_key.write_bytes(public + f" fedspear-{name}\n".encode())
    return keys


def verify_server_certificate(ca_cert: str | Path, server_cert: str | Path, host: str) -> None:
    """Check that ``server_cert`` is signed by ``ca_cert``, is valid now, and names ``host`` (what a TLS client checks).

    Raises:
        ValueError: the signature, validity period or host name does not match (the message says which).
    """
    ca = x509.load_pem_x509_certificate(Path(ca_cert).read_bytes())
    cert = x509.load_pem_x509_certificate(Path(server_cert).read_bytes())
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{server_cert} is not issued by {ca_cert}: {err}") from None
    except Exception as err:  # cryptography.exceptions.InvalidSignature
        raise ValueError(f"{server_cert}: signature does not verify against {ca_cert} ({type(err).__name__})") from None
    now = dt.datetime.now(dt.timezone.utc)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise ValueError(f"{server_cert} is not valid now ({cert.not_valid_before_utc} .. {cert.not_valid_after_utc})")
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    try:
        wanted: object = ipaddress.ip_address(host)
        found = wanted in names.get_values_for_type(x509.IPAddress)
    except ValueError:
        found = host in names.get_values_for_type(x509.DNSName)
    if not found:
        raise ValueError(f"{server_cert} does not name {host} (names: {[str(n.value) for n in names]})")
