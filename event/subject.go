package event

import (
	"fmt"
	"hash/fnv"
	"regexp"
	"strconv"
	"strings"
	"unicode/utf8"
)

// SubjectPrefix is the first token of every Epitaph subject.
const SubjectPrefix = "epitaph"

var sourceNameRE = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)

// ValidateSourceName checks that a source name can be used in stream names,
// subjects and message ids unescaped.
func ValidateSourceName(src string) error {
	if !sourceNameRE.MatchString(src) {
		return fmt.Errorf("source name %q: use 1-64 characters of A-Z, a-z, 0-9, '_' or '-'", src)
	}
	return nil
}

// StreamName is the JetStream stream of a source: EPITAPH_<SOURCE>.
func StreamName(src string) string { return "EPITAPH_" + strings.ToUpper(src) }

// ErasedBucket is the JetStream KV bucket of source src's erasure ledger:
// EPITAPH_<SOURCE>_ERASED, a record of every message an erasure deleted
// from the stream (projector erase --purge-stream).
func ErasedBucket(src string) string { return StreamName(src) + "_ERASED" }

// RowBucket is the object store bucket of source src holding the rows too
// large for one message (a delete's row_ref names it).
func RowBucket(src string) string { return "epitaph_" + src + "_rows" }

// EscapeToken makes any SQL identifier safe as one subject token: '.', '*',
// '>', '%', whitespace, control characters and non-ASCII bytes are
// percent-encoded (%XX, upper-case hex, per UTF-8 byte).
func EscapeToken(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c <= ' ' || c >= 0x7f || c == '.' || c == '*' || c == '>' || c == '%' {
			fmt.Fprintf(&b, "%%%02X", c)
			continue
		}
		b.WriteByte(c)
	}
	return b.String()
}

// UnescapeToken reverses EscapeToken.
func UnescapeToken(s string) (string, error) {
	if !strings.Contains(s, "%") {
		return s, nil
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] != '%' {
			b.WriteByte(s[i])
			continue
		}
		if i+2 >= len(s) {
			return "", fmt.Errorf("unescape %q: truncated escape at %d", s, i)
		}
		v, err := strconv.ParseUint(s[i+1:i+3], 16, 8)
		if err != nil {
			return "", fmt.Errorf("unescape %q: bad escape at %d", s, i)
		}
		b.WriteByte(byte(v))
		i += 2
	}
	out := b.String()
	if !utf8.ValidString(out) {
		return "", fmt.Errorf("unescape %q: not UTF-8", s)
	}
	return out, nil
}

func base(src string, p int) string {
	return SubjectPrefix + "." + src + "." + strconv.Itoa(p)
}

// DeleteSubject is epitaph.<src>.<p>.delete.<schema>.<table>.
func DeleteSubject(src string, p int, schema, table string) string {
	return base(src, p) + ".delete." + EscapeToken(schema) + "." + EscapeToken(table)
}

// TruncateSubject is epitaph.<src>.<p>.truncate.<schema>.<table>.
func TruncateSubject(src string, p int, schema, table string) string {
	return base(src, p) + ".truncate." + EscapeToken(schema) + "." + EscapeToken(table)
}

// CommitSubject is epitaph.<src>.<p>.commit.
func CommitSubject(src string, p int) string { return base(src, p) + ".commit" }

// MarkSubject is epitaph.<src>.<p>.mark (marks and heartbeats).
func MarkSubject(src string, p int) string { return base(src, p) + ".mark" }

// GapSubject is epitaph.<src>.<p>.gap.
func GapSubject(src string, p int) string { return base(src, p) + ".gap" }

// SettleSubject is epitaph.<src>.settle, outside every partition: the
// capture's probe at the start of a session, which JetStream refuses (an
// invalid header), so nothing is stored under it.
func SettleSubject(src string) string { return SubjectPrefix + "." + src + ".settle" }

// PartitionFilter matches every subject of one partition.
func PartitionFilter(src string, p int) string { return base(src, p) + ".>" }

// StreamSubjects matches every subject of a source.
func StreamSubjects(src string) string { return SubjectPrefix + "." + src + ".>" }

// PartitionOf extracts the partition number from a subject of source src.
func PartitionOf(subject string) (int, error) {
	parts := strings.SplitN(subject, ".", 4)
	if len(parts) < 4 || parts[0] != SubjectPrefix {
		return 0, fmt.Errorf("subject %q is not an epitaph subject", subject)
	}
	p, err := strconv.Atoi(parts[2])
	if err != nil || p < 0 {
		return 0, fmt.Errorf("subject %q: bad partition %q", subject, parts[2])
	}
	return p, nil
}

// Partition chooses the partition of a source transaction: FNV-1a of the
// commit LSN's 8 big-endian bytes, modulo n. All messages of one transaction
// share it.
func Partition(commitLSN LSN, n int) int {
	if n <= 1 {
		return 0
	}
	h := fnv.New32a()
	var b [8]byte
	for i := 0; i < 8; i++ {
		b[i] = byte(commitLSN >> (56 - 8*i))
	}
	h.Write(b[:])
	return int(h.Sum32() % uint32(n))
}

// MsgID is the plain Nats-Msg-Id of a row or truncate message:
// <src>/<lsn>/<seq>. The capture publishes it tagged (MsgIDTagger.RowMsgID).
func MsgID(src string, commitLSN LSN, seq int) string {
	return src + "/" + commitLSN.String() + "/" + strconv.Itoa(seq)
}

// CommitMsgID is the plain Nats-Msg-Id of a commit message. The capture
// publishes it tagged (MsgIDTagger.CommitMsgID); an older capture did not.
func CommitMsgID(src string, commitLSN LSN) string {
	return src + "/" + commitLSN.String() + "/commit"
}

// MarkMsgID is the plain Nats-Msg-Id of a mark or heartbeat copy for
// partition p (published tagged: MsgIDTagger.MarkMsgID).
func MarkMsgID(src string, lsn LSN, p int) string {
	return src + "/" + lsn.String() + "/mark/" + strconv.Itoa(p)
}

// GapMsgID is the plain Nats-Msg-Id of a gap copy for partition p
// (published tagged: MsgIDTagger.GapMsgID).
func GapMsgID(src string, from, to LSN, p int) string {
	return src + "/gap/" + from.String() + "-" + to.String() + "/" + strconv.Itoa(p)
}

// TableGapMsgID is the plain Nats-Msg-Id of a gap copy for partition p
// that concerns one table only, distinct from the whole-source gap of the
// same range and from another table's (published tagged:
// MsgIDTagger.TableGapMsgID).
func TableGapMsgID(src, schema, table string, from, to LSN, p int) string {
	return src + "/gap/" + EscapeToken(schema) + "." + EscapeToken(table) + "/" + from.String() + "-" + to.String() + "/" + strconv.Itoa(p)
}
