package handler_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/epitaph-dev/epitaph/handler"
)

// purgeBlob is a Go row handler: it removes the blob a deleted attachment
// row named. It is idempotent (a retried delivery finds the blob gone) and
// says which failures a retry cannot fix.
type purgeBlob struct{ store map[string][]byte }

func (p purgeBlob) Handle(_ context.Context, d handler.Delivery) error {
	var name string
	if raw, ok := d.Columns["blob_name"]; ok {
		name = string(raw)
	}
	if name == "" {
		return handler.Permanent("no_blob_name", errors.New("the handler keeps no blob_name column"))
	}
	delete(p.store, name) // deleting twice is fine
	return nil
}

// An embedding program registers its Go handlers by name; a handler of
// kind "go" added with `projector handlers add --kind go --target
// purge-blob` is then run by that program's dispatcher, which calls Handle
// with each claimed delivery.
func ExampleRegistry() {
	store := map[string][]byte{`"a.png"`: {1}, `"b.png"`: {2}}
	reg := handler.NewRegistry()
	if err := reg.Register("purge-blob", purgeBlob{store: store}); err != nil {
		fmt.Println(err)
		return
	}
	h, ok := reg.Lookup("purge-blob")
	fmt.Println(reg.Names(), ok)

	d := handler.Delivery{Schema: "public", Table: "attachments", Attempt: 1,
		Columns: map[string]json.RawMessage{"blob_name": json.RawMessage(`"a.png"`)}}
	fmt.Println(h.Handle(context.Background(), d), len(store))
	d.Attempt = 2 // a retry finds the work done
	fmt.Println(h.Handle(context.Background(), d), len(store))
	d.Columns = nil
	fmt.Println(h.Handle(context.Background(), d) != nil)
	// Output:
	// [purge-blob] true
	// <nil> 1
	// <nil> 1
	// true
}
