package broker

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nkeys"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/natsconn"
)

// Auth makes an embedded server require credentials: one writer, the
// capture. The server runs in operator mode with an in-memory account
// resolver: one operator, a system account and one account with JetStream,
// whose three users are the roles, each limited to the source's own
// streams (its stream, row object store and erasure ledger):
//
//   - capture: publishes the source's subjects (epitaph.<source>.>),
//     creates, updates and reads its stream, writes its row object store;
//     it cannot delete or purge messages of its stream, or touch any other
//     stream or JetStream API;
//   - projector: consumes (creates, reads and deletes consumers of the
//     source's stream, fetches and acknowledges), reads stream information,
//     messages, the object store and the erasure ledger; it cannot publish
//     to epitaph.>, write objects, change a stream or delete messages;
//   - erase: what the projector may, and securely deleting single messages
//     of the stream and the object store and recording them in the erasure
//     ledger (projector erase --purge-stream). Kept apart from the running
//     projectors' credentials: a message deleted before every target
//     applied it is lost to those targets, so only the operator's erase
//     may remove one.
//
// Each user subscribes only to its own inboxes, _INBOX.<user>.>
// (natsconn.InboxPrefix), so no user reads another's JetStream replies or
// deliveries. The projectors of one target may have a user of their own,
// projector_<target> (WriteTargetCreds): the projector's permissions and
// its own inboxes.
//
// The keys live in Dir and are made on the first start, so every restart
// keeps the same identities; the users' credentials are Dir/capture.creds,
// Dir/projector.creds, Dir/erase.creds and Dir/projector_<target>.creds in
// the standard NATS format (natsconn.UserCredentials reads them).
// Dir/revoked-users lists the users' keys the server refuses
// (RevokeTargetCreds). Dir is 0700, every file in it 0600.
type Auth struct {
	// Dir holds the keys and the credentials files. Required.
	Dir string
	// Source is the source name: the capture may publish epitaph.<Source>.>.
	Source string
}

// Credentials file names in Auth.Dir.
const (
	CaptureCredsFile   = "capture.creds"
	ProjectorCredsFile = "projector.creds"
	EraseCredsFile     = "erase.creds"
)

// User names of the roles (the names in their JWTs, and of their inboxes).
const (
	CaptureUser   = "capture"
	ProjectorUser = "projector"
	EraseUser     = "erase"
)

// CaptureCreds and ProjectorCreds are the paths of the roles' credentials
// under dir (an Auth.Dir).
func CaptureCreds(dir string) string   { return filepath.Join(dir, CaptureCredsFile) }
func ProjectorCreds(dir string) string { return filepath.Join(dir, ProjectorCredsFile) }

// EraseCreds is the path of the erase role's credentials under dir.
func EraseCreds(dir string) string { return filepath.Join(dir, EraseCredsFile) }

// Key seed files in Auth.Dir (never shown; only the server's process reads them).
const (
	operatorSeedFile = "operator.nk"
	systemSeedFile   = "system-account.nk"
	accountSeedFile  = "account.nk"
)

// AccountName is the name in the JWT of the account the roles share.
const AccountName = "EPITAPH"

// Stream names of a source's JetStream data: its stream, the object store
// of rows too large for a message, and the erasure ledger (a KV bucket).
func streamsOf(source string) (stream, rows, ledger string) {
	return event.StreamName(source), "OBJ_" + event.RowBucket(source), "KV_" + event.ErasedBucket(source)
}

// readStream is reading one stream: its information, single messages (by
// sequence or last by subject, direct or through the API).
func readStream(name string) []string {
	return []string{
		"$JS.API.STREAM.INFO." + name,
		"$JS.API.STREAM.MSG.GET." + name,
		"$JS.API.DIRECT.GET." + name,
		"$JS.API.DIRECT.GET." + name + ".>",
	}
}

// consumeStream is consuming one stream: creating, reading and deleting
// its consumers, fetching, acknowledging and answering flow control. Not
// listing, pausing, unpinning or resetting them, or stepping their leaders
// down.
func consumeStream(name string) []string {
	return []string{
		"$JS.API.CONSUMER.CREATE." + name,
		"$JS.API.CONSUMER.CREATE." + name + ".>",
		"$JS.API.CONSUMER.INFO." + name + ".*",
		"$JS.API.CONSUMER.DELETE." + name + ".*",
		"$JS.API.CONSUMER.MSG.NEXT." + name + ".*",
		"$JS.ACK." + name + ".>",
		"$JS.FC." + name + ".>",
	}
}

// CapturePermissions are what the capture role of one source may do:
// publish the source's subjects; create, update and read its stream (and
// read it back through consumers of its own); create and write the row
// object store (an object put again purges the object's old chunks).
// Nothing of any other stream, no other JetStream API.
func CapturePermissions(source, user string) jwt.Permissions {
	stream, rows, _ := streamsOf(source)
	allow := jwt.StringList{event.StreamSubjects(source), "$JS.API.INFO",
		"$JS.API.STREAM.CREATE." + stream, "$JS.API.STREAM.UPDATE." + stream}
	allow = append(allow, readStream(stream)...)
	allow = append(allow, consumeStream(stream)...)
	allow = append(allow, "$JS.API.STREAM.CREATE."+rows, "$JS.API.STREAM.PURGE."+rows, "$O."+event.RowBucket(source)+".>")
	allow = append(allow, readStream(rows)...)
	return jwt.Permissions{
		Pub: jwt.Permission{Allow: allow,
			// The writer never removes: no stream or message deletes, no
			// purge of its stream. Removing is the operator's, not the
			// writer's, so a leaked capture credential can forge (and be
			// caught) but not erase what was written. Stated for whoever
			// reads the JWT: the allow list grants none of these already.
			Deny: jwt.StringList{
				"$JS.API.STREAM.DELETE.*",
				"$JS.API.STREAM.MSG.DELETE.*",
				"$JS.API.STREAM.PURGE." + stream,
			}},
		Sub: inboxOnly(user),
	}
}

// inboxOnly is subscribing only to the inboxes of user (the prefix every
// Epitaph client of that user takes, natsconn.InboxPrefix): no other
// client's replies or deliveries, whose reply subjects name consumers.
func inboxOnly(user string) jwt.Permission {
	return jwt.Permission{Allow: jwt.StringList{natsconn.InboxPrefix(user) + ".>"}}
}

// ProjectorPermissions are what the projector role of one source may do,
// as the NATS user named user: exactly what the projector (run, status,
// versions, quarantine replay, wait) uses. It reads the source's stream,
// row object store and erasure ledger, and consumes the stream and the
// object store; it cannot publish to epitaph.>, write objects, delete or
// purge messages, or change a stream, and it subscribes to its own
// inboxes only. JetStream permissions are by subject token and a
// consumer's name is one token, so the role may reach any consumer of the
// stream whose name it knows; it cannot list them, and a partition
// worker's consumer name carries a random part recorded only in its
// target's database, so another target's user (or the capture) cannot
// find it.
func ProjectorPermissions(source, user string) jwt.Permissions {
	stream, rows, ledger := streamsOf(source)
	allow := jwt.StringList{"$JS.API.INFO"}
	for _, s := range []string{stream, rows, ledger} {
		allow = append(allow, readStream(s)...)
	}
	allow = append(allow, consumeStream(stream)...)
	allow = append(allow, consumeStream(rows)...)
	return jwt.Permissions{
		Pub: jwt.Permission{
			Allow: allow,
			// Stated for whoever reads the JWT: never the stream, never objects.
			Deny: jwt.StringList{event.SubjectPrefix + ".>", "$O.>"},
		},
		Sub: inboxOnly(user),
	}
}

// ErasePermissions are the projector's, the secure delete of single
// messages of the source's stream and row object store (an erased row and
// its object's chunks) and the source's erasure ledger: creating its bucket
// and putting there what it deletes (projector erase --purge-stream). No
// purge, no stream delete. The projector role only reads the ledger.
func ErasePermissions(source, user string) jwt.Permissions {
	stream, rows, ledger := streamsOf(source)
	p := ProjectorPermissions(source, user)
	p.Pub.Allow = append(p.Pub.Allow,
		"$JS.API.STREAM.MSG.DELETE."+stream, "$JS.API.STREAM.MSG.DELETE."+rows,
		"$JS.API.STREAM.CREATE."+ledger,
		"$KV."+event.ErasedBucket(source)+".>")
	return p
}

// identities are the keys of an embedded server's operator mode.
type identities struct {
	operator, system, account nkeys.KeyPair
	opClaims                  *jwt.OperatorClaims
	accountJWT, systemJWT     string
}

// ensureAuth makes (or loads) the keys and credentials under a.Dir and
// sets the server options that enforce them. It returns what the running
// server needs to apply later revocations (liveAuth), whose accPub is the
// account's public key (the name of its JetStream directory).
func ensureAuth(a Auth, opts *server.Options) (*liveAuth, error) {
	if a.Dir == "" {
		return nil, errors.New("embedded jetstream: a credentials directory is required")
	}
	if err := os.MkdirAll(a.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("embedded jetstream: credentials directory: %w", err)
	}
	if err := os.Chmod(a.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("embedded jetstream: credentials directory: %w", err)
	}
	var id identities
	var err error
	if id.operator, err = loadOrMakeSeed(filepath.Join(a.Dir, operatorSeedFile), nkeys.CreateOperator); err != nil {
		return nil, err
	}
	if id.system, err = loadOrMakeSeed(filepath.Join(a.Dir, systemSeedFile), nkeys.CreateAccount); err != nil {
		return nil, err
	}
	if id.account, err = loadOrMakeSeed(filepath.Join(a.Dir, accountSeedFile), nkeys.CreateAccount); err != nil {
		return nil, err
	}
	opPub, _ := id.operator.PublicKey()
	sysPub, _ := id.system.PublicKey()
	accPub, _ := id.account.PublicKey()

	id.opClaims = jwt.NewOperatorClaims(opPub)
	id.opClaims.Name = "epitaph"
	id.opClaims.SystemAccount = sysPub
	if _, err := id.opClaims.Encode(id.operator); err != nil {
		return nil, fmt.Errorf("embedded jetstream: operator: %w", err)
	}
	sys := jwt.NewAccountClaims(sysPub)
	sys.Name = "SYS"
	if id.systemJWT, err = sys.Encode(id.operator); err != nil {
		return nil, fmt.Errorf("embedded jetstream: system account: %w", err)
	}
	acc := jwt.NewAccountClaims(accPub)
	acc.Name = AccountName
	acc.Limits.JetStreamLimits = jwt.JetStreamLimits{MemoryStorage: -1, DiskStorage: -1, Streams: -1, Consumer: -1}
	live := &liveAuth{dir: a.Dir, operator: id.operator, accPub: accPub, claims: acc, revoked: map[string]bool{}}
	raw, err := os.ReadFile(filepath.Join(a.Dir, revokedFile))
	live.seen = revokedSignature(raw, err)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("embedded jetstream: read the revoked users: %w", err)
	}
	revoked, err := parseRevoked(a.Dir, raw)
	if err != nil {
		return nil, err
	}
	for _, pub := range revoked {
		acc.Revoke(pub) // every JWT of that key issued until now
		live.revoked[pub] = true
	}
	if id.accountJWT, err = acc.Encode(id.operator); err != nil {
		return nil, fmt.Errorf("embedded jetstream: account: %w", err)
	}

	if err := ensureCreds(CaptureCreds(a.Dir), CaptureUser, id.account, CapturePermissions(a.Source, CaptureUser)); err != nil {
		return nil, err
	}
	if err := ensureCreds(ProjectorCreds(a.Dir), ProjectorUser, id.account, ProjectorPermissions(a.Source, ProjectorUser)); err != nil {
		return nil, err
	}
	if err := ensureCreds(EraseCreds(a.Dir), EraseUser, id.account, ErasePermissions(a.Source, EraseUser)); err != nil {
		return nil, err
	}
	if err := refreshTargetCreds(a, id.account); err != nil {
		return nil, err
	}

	res := &server.MemAccResolver{}
	if err := res.Store(sysPub, id.systemJWT); err != nil {
		return nil, fmt.Errorf("embedded jetstream: system account: %w", err)
	}
	if err := res.Store(accPub, id.accountJWT); err != nil {
		return nil, fmt.Errorf("embedded jetstream: account: %w", err)
	}
	live.res = res
	opts.TrustedOperators = []*jwt.OperatorClaims{id.opClaims}
	opts.AccountResolver = res
	opts.SystemAccount = sysPub
	return live, nil
}

// loadOrMakeSeed reads an nkey seed file, or makes the key and writes it
// (0600) when the file does not exist.
func loadOrMakeSeed(path string, create func() (nkeys.KeyPair, error)) (nkeys.KeyPair, error) {
	raw, err := os.ReadFile(path)
	if err == nil {
		kp, err := nkeys.FromSeed(bytes.TrimSpace(raw))
		if err != nil {
			return nil, fmt.Errorf("embedded jetstream: key %s is not an nkey seed (remove the credentials directory to make new keys: every client then needs the new .creds files)", path)
		}
		if err := os.Chmod(path, 0o600); err != nil {
			return nil, fmt.Errorf("embedded jetstream: key %s: %w", path, err)
		}
		return kp, nil
	}
	if !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("embedded jetstream: read key: %w", err)
	}
	kp, err := create()
	if err != nil {
		return nil, fmt.Errorf("embedded jetstream: make key: %w", err)
	}
	seed, _ := kp.Seed()
	if err := writeFileAtomic(path, append(seed, '\n')); err != nil {
		return nil, err
	}
	return kp, nil
}

// ensureCreds keeps the user of an existing credentials file (its key) and
// writes a new JWT only when the file is missing, not issued by this
// account, or grants other permissions than perms; so a restart neither
// changes a role's identity nor rewrites a file a client may be reading.
func ensureCreds(path, name string, account nkeys.KeyPair, perms jwt.Permissions) error {
	accPub, _ := account.PublicKey()
	var user nkeys.KeyPair
	if raw, err := os.ReadFile(path); err == nil {
		if kp, err := jwt.ParseDecoratedNKey(raw); err == nil {
			if tok, err := jwt.ParseDecoratedJWT(raw); err == nil {
				if uc, err := jwt.DecodeUserClaims(tok); err == nil && uc.Issuer == accPub && samePermissions(uc.Permissions, perms) {
					if pub, _ := kp.PublicKey(); pub == uc.Subject {
						return os.Chmod(path, 0o600)
					}
				}
			}
			user = kp
		}
	} else if !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("embedded jetstream: read %s: %w", path, err)
	}
	if user == nil {
		kp, err := nkeys.CreateUser()
		if err != nil {
			return fmt.Errorf("embedded jetstream: make user key: %w", err)
		}
		user = kp
	}
	pub, _ := user.PublicKey()
	uc := jwt.NewUserClaims(pub)
	uc.Name = name
	uc.Permissions = perms
	tok, err := uc.Encode(account)
	if err != nil {
		return fmt.Errorf("embedded jetstream: %s credentials: %w", name, err)
	}
	seed, _ := user.Seed()
	creds, err := jwt.FormatUserConfig(tok, seed)
	if err != nil {
		return fmt.Errorf("embedded jetstream: %s credentials: %w", name, err)
	}
	// Said in the file, for whoever gives it to another NATS tool: the
	// user may subscribe to its own inboxes only.
	note := fmt.Sprintf("# NATS user %q of Epitaph's embedded broker. It receives replies only on\n"+
		"# %s.>: clients other than Epitaph's must use that inbox prefix\n"+
		"# (nats CLI: --inbox-prefix %s; nats.go: nats.CustomInboxPrefix).\n\n",
		name, natsconn.InboxPrefix(name), natsconn.InboxPrefix(name))
	return writeFileAtomic(path, append([]byte(note), creds...))
}

func samePermissions(a, b jwt.Permissions) bool {
	ja, _ := json.Marshal(a)
	jb, _ := json.Marshal(b)
	return bytes.Equal(ja, jb)
}

// writeFileAtomic writes a 0600 file by renaming a complete temporary one
// over it.
func writeFileAtomic(path string, data []byte) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*")
	if err != nil {
		return fmt.Errorf("embedded jetstream: write %s: %w", path, err)
	}
	defer os.Remove(tmp.Name()) // after the rename, a no-op
	err = tmp.Chmod(0o600)
	if err == nil {
		_, err = tmp.Write(data)
	}
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), path)
	}
	if err != nil {
		return fmt.Errorf("embedded jetstream: write %s: %w", path, err)
	}
	return nil
}

// migrateGlobalAccount moves JetStream data written by an embedded server
// without authentication (account $G) to the account the roles use, so a
// capture upgraded in place keeps its stream.
func migrateGlobalAccount(storeDir, accountDir string) error {
	js := filepath.Join(storeDir, "jetstream")
	from, to := filepath.Join(js, server.DEFAULT_GLOBAL_ACCOUNT), filepath.Join(js, accountDir)
	if _, err := os.Stat(from); err != nil {
		return nil
	}
	if _, err := os.Stat(to); err == nil {
		return nil
	}
	if err := os.Rename(from, to); err != nil {
		return fmt.Errorf("embedded jetstream: move the unauthenticated server's data to account %s: %w", AccountName, err)
	}
	return nil
}
