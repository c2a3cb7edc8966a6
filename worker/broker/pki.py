"""A private certificate authority for the local broker: a CA, the broker's certificate and client certificates.

Everything is PEM, which both sides read without conversion: Kafka takes `ssl.keystore.type=PEM` (the key and
its chain in one file) and `ssl.truststore.type=PEM`; Python's ssl module and librdkafka take the same files.
Keys are EC P-256: quick to make and to handshake with on a small machine.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=825)


@dataclass(slots=True)
class Issued:
    """One certificate and its key, as written to disk."""

    cert_path: Path
    key_path: Path
    """The private key, PKCS#8 PEM; encrypted when issued with a password."""
    bundle_path: Path
    """Key, certificate and CA certificate in one file: the shape of Kafka's PEM keystore."""


@dataclass(slots=True)
class CertificateAuthority:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey
    cert_path: Path

    @classmethod
    def create(cls, folder: Path, common_name: str = "llm-worker local CA") -> "CertificateAuthority":
        folder.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        now = _now()
        cert = (
            x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )  # fmt: skip
        cert_path = folder / "ca.pem"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_private(folder / "ca.key", _key_pem(key, None))
        return cls(cert, key, cert_path)

    @classmethod
    def load(cls, folder: Path) -> "CertificateAuthority":
        cert_path = folder / "ca.pem"
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key((folder / "ca.key").read_bytes(), password=None)
        return cls(cert, key, cert_path)

    def issue(self, folder: Path, common_name: str, *, server: bool = False, password: str | None = None,
              not_before: datetime.datetime | None = None, not_after: datetime.datetime | None = None) -> Issued:
        """A certificate for `common_name`, written as <common_name>.pem/.key/-bundle.pem in `folder`.

        server=True: valid for TLS servers on 127.0.0.1 and localhost (the names clients verify); every
        certificate is also a client certificate, as Kafka's broker uses its own for inter-broker links.
        """
        folder.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH] + ([ExtendedKeyUsageOID.SERVER_AUTH] if server else [])
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self.cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(not_before or now - datetime.timedelta(minutes=5))
            .not_valid_after(not_after or now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False)
        )  # fmt: skip
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        cert_pem = cert.public_bytes(serialization.Encoding.PEM)
        key_pem = _key_pem(key, password)
        ca_pem = self.cert.public_bytes(serialization.Encoding.PEM)
        issued = Issued(folder / f"{common_name}.pem", folder / f"{common_name}.key",
                        folder / f"{common_name}-bundle.pem")
        issued.cert_path.write_bytes(cert_pem)
        _write_private(issued.key_path, key_pem)
        _write_private(issued.bundle_path, key_pem + cert_pem + ca_pem)
        return issued


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _key_pem(key: ec.EllipticCurvePrivateKey, password: str | None) -> bytes:
    encryption = (serialization.BestAvailableEncryption(password.encode()) if password
                  else serialization.NoEncryption())
    # PKCS#8: the one private-key encoding Kafka's PEM keystore reads.
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)


def _write_private(path: Path, data: bytes) -> None:
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_bytes(data)
