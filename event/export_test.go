package event

// DecodeFast and DecodeSlow expose Decode's two paths to the fuzz tests.
func DecodeFast(data []byte) (*Event, bool) { return decodeFast(data) }

func DecodeSlow(data []byte) (*Event, error) { return (&Decoder{}).decodeSlow(data) }
