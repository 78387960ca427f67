"""Test certificates made with openssl: a CA and leaves it signs (CN = the peer's name)."""
import subprocess


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(d, name):
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=keyCertSign,cRLSign", cwd=d)
    return f"{name}.pem", f"{name}.key"


def make_leaf(d, ca, name, dns_name=None):
    """A leaf certificate for ``name``; ``dns_name``: also a DNS subject alternative name (discovery checks
    a peer's certificate against its name)."""
    ca_pem, ca_key = ca
    extra = f",DNS:{dns_name}" if dns_name else ""
    (d / "ext.cnf").write_text(f"subjectAltName=DNS:localhost,IP:127.0.0.1{extra}\n"
                               "extendedKeyUsage=serverAuth,clientAuth\n")
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", ca_pem, "-CAkey", ca_key, "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", "ext.cnf", cwd=d)
    return str(d / f"{name}.pem"), str(d / f"{name}.key")
